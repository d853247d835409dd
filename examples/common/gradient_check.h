// SPDX-License-Identifier: BSD-3-Clause
// Checks the gradients amp hands an optimizer against float64: the same loss,
// computed in plain LibTorch at the same weights. Examples run it each step
// when asked (--check_gradients); their tests do.
#pragma once

#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include <torch/torch.h>

namespace examples {

// A float64 copy of `model` holding the weights `optimizer` steps (fp32
// masters at O2/O5) and the model's buffers. `optimizer` must have been made
// over model->parameters(), in that order.
template <class Holder>
Holder float64_copy(const Holder& model, torch::optim::Optimizer& optimizer) {
  Holder copy;
  copy->to(torch::kDouble);
  torch::NoGradGuard no_grad;
  const auto weights = amp::master_params(optimizer);
  auto params = copy->parameters();
  TORCH_CHECK(weights.size() == params.size(), "float64_copy: the optimizer steps ", weights.size(),
              " tensors, the model has ", params.size(), " parameters");
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(weights[i]);
  auto buffers = copy->buffers();
  const auto source = model->buffers();
  for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(source[i]);
  return copy;
}

// ||g - g_ref|| / ||g_ref|| over every gradient `optimizer` would step and
// the matching gradients of `reference` (a float64_copy after backward).
double relative_gradient_error(torch::optim::Optimizer& optimizer, const torch::nn::Module& reference);

}  // namespace examples
