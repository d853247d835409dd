// SPDX-License-Identifier: BSD-3-Clause
#include "autograd/accumulator_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace amp::detail {

bool AccumulatorHooks::add(const at::Tensor& leaf, std::function<void()> on_gradient) {
  std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::try_get_grad_accumulator(leaf);
  if (!accumulator) return false;
  const uintptr_t key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [on_gradient = std::move(on_gradient)](const torch::autograd::variable_list& outputs,
                                             const torch::autograd::variable_list&) {
        on_gradient();
        return outputs;
      }));
  hooks_.emplace_back(std::move(accumulator), key);
  return true;
}

void AccumulatorHooks::clear() noexcept {
  for (auto& [accumulator, key] : hooks_) accumulator->del_post_hook(key);
  hooks_.clear();
}

}  // namespace amp::detail
