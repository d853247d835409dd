// SPDX-License-Identifier: BSD-3-Clause
// The kernel of amp::optim::FusedSGD: LibTorch's SGD step
// (torch/optim/sgd.cpp) as ATen's _fused_sgd_, one call per dtype, rounding
// and first step (on CUDA, amp's one kernel for the widened parameters: O6's,
// 8-bit state's). Parameters without a momentum buffer yet take their first
// step, which sets it to the gradient.
#include "optim/fused_kernel.h"

#include <torch/optim/sgd.h>

#include <ATen/ATen.h>

#include <map>
#include <optional>
#include <tuple>

namespace amp::optim::internal {
namespace {

class SgdKernel final : public FusedKernel {
 public:
  bool needs_state(const torch::optim::OptimizerOptions&, size_t) const override { return true; }
  bool steps_low_precision_on_cpu() const override { return false; }

  void step(GroupStep& g) const override {
    const auto& options = static_cast<const torch::optim::SGDOptions&>(g.group.options());
    const bool momentum = options.momentum() != 0;
    struct Batch {
      std::vector<at::Tensor> params, grads, buffers;
      std::vector<uint64_t> keys;  // rounding keys
    };
    // One kernel call per (dtype, widened, first step): ATen's kernels take
    // one dtype per call.
    std::map<std::tuple<c10::ScalarType, bool, bool>, Batch> batches;
    for (size_t i = 0; i < g.params.size(); ++i) {
      const at::Tensor& p = g.params[i];
      if (!p.grad().defined()) continue;
      void* key = p.unsafeGetTensorImpl();
      const bool widened = steps_widened(p, g.precision);
      bool first = false;
      at::Tensor buffer;
      if (momentum) {
        auto it = g.state.find(key);
        if (it == g.state.end()) {
          auto fresh = std::make_unique<torch::optim::SGDParamState>();
          fresh->momentum_buffer(zero_state(p, g.precision, /*non_negative=*/false));
          it = g.state.emplace(key, std::move(fresh)).first;
          g.attempt.created.push_back(key);
          first = true;
        }
        buffer = static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer();
      }
      Batch& batch = batches[{p.scalar_type(), widened, first}];
      if (buffer.defined()) batch.buffers.push_back(buffer);
      batch.params.push_back(p);
      batch.keys.push_back(g.keys[i]);
      batch.grads.push_back(p.grad());
    }
    for (const auto& entry : batches) {
      const bool widened = std::get<1>(entry.first), first = std::get<2>(entry.first);
      const Batch& batch = entry.second;
      std::optional<at::Tensor> flag;
      if (g.found_inf.defined()) flag = g.found_inf.to(batch.params.front().device());
      auto kernel = [&](at::TensorList params, at::TensorList grads, at::TensorList buffers) {
        at::_fused_sgd_(params, grads, buffers, options.weight_decay(), options.momentum(), options.lr(),
                        options.dampening(), options.nesterov(), /*maximize=*/false, /*is_first_step=*/first,
                        /*grad_scale=*/std::nullopt, flag);
      };
      if (!widened) {
        kernel(batch.params, batch.grads, batch.buffers);
        continue;
      }
      const std::vector<WideColumn> columns = {{&batch.params, true}, {&batch.grads}, {&batch.buffers, true}};
#ifdef AMP_WITH_CUDA_KERNELS
      // On CUDA one kernel decodes, steps and codes back every slice.
      if (const auto slices = pieces_in_place(columns, batch.keys, *g.precision); !slices.empty()) {
        detail::sgd_on_cuda(slices, {options.lr(), options.weight_decay(), options.momentum(), options.dampening(),
                                     options.nesterov(), first, flag.value_or(at::Tensor())});
        continue;
      }
#endif
      step_widened(columns, batch.keys, *g.precision,
                   [&](const std::vector<std::vector<at::Tensor>>& w) { kernel(w[0], w[1], w[2]); });
    }
  }
};

}  // namespace

const FusedKernel& Fusable<torch::optim::SGD>::kernel() {
  static const SgdKernel sgd;
  return sgd;
}

}  // namespace amp::optim::internal
