// SPDX-License-Identifier: BSD-3-Clause
// The kernels of amp::optim::FusedAdam and FusedAdamW: LibTorch's Adam /
// AdamW step (torch/optim/adam.cpp, adamw.cpp) with the state it would
// create, as one ATen _fused_adam_ / _fused_adamw_ call per group and dtype
// (per chunk for widened parameters: O6's, 8-bit state's; on CUDA amp's one
// kernel for all of those), reading step counts kept on the device.
#include "optim/fused_kernel.h"

#include <ATen/ATen.h>

#include <map>
#include <optional>
#include <type_traits>

namespace amp::optim::internal {
namespace {

template <class Options, class ParamState>
class AdamKernel final : public FusedKernel {
 public:
  bool needs_state(const torch::optim::OptimizerOptions& options, size_t index) const override {
    return index < 2 || static_cast<const Options&>(options).amsgrad();  // exp_avg, exp_avg_sq, max_exp_avg_sq
  }
  bool counts_steps() const override { return true; }

  void step(GroupStep& g) const override {
    const auto& options = static_cast<const Options&>(g.group.options());
    struct Lists {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
      std::vector<uint64_t> keys;  // rounding keys
    };
    // ATen's kernels take one dtype per call: direct parameters by dtype
    // (float32 with float16 at O3's kept-float32 batch norms), and the
    // widened ones (O6's rounded weights, 8-bit state), stepped in float32 a
    // chunk at a time.
    std::map<c10::ScalarType, Lists> direct;
    Lists widened;
    for (size_t i = 0; i < g.params.size(); ++i) {
      const at::Tensor& p = g.params[i];
      if (!p.grad().defined()) continue;
      void* key = p.unsafeGetTensorImpl();
      auto it = g.state.find(key);
      if (it == g.state.end()) {
        auto fresh = std::make_unique<ParamState>();
        fresh->exp_avg(zero_state(p, g.precision, /*non_negative=*/false));
        fresh->exp_avg_sq(zero_state(p, g.precision, /*non_negative=*/true));
        if (options.amsgrad()) fresh->max_exp_avg_sq(zero_state(p, g.precision, /*non_negative=*/true));
        it = g.state.emplace(key, std::move(fresh)).first;
        g.attempt.created.push_back(key);
      }
      auto& s = static_cast<ParamState&>(*it->second);
      Lists& lists = steps_widened(p, g.precision) ? widened : direct[p.scalar_type()];
      lists.params.push_back(p);
      lists.keys.push_back(g.keys[i]);
      lists.grads.push_back(p.grad());
      lists.exp_avgs.push_back(s.exp_avg());
      lists.exp_avg_sqs.push_back(s.exp_avg_sq());
      if (options.amsgrad()) lists.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
      lists.steps.push_back(g.device_step(key, s.step(), p));
      g.attempt.stepped.push_back(key);
    }
    std::vector<Lists*> all;
    for (auto& [dtype, lists] : direct) all.push_back(&lists);
    if (!widened.params.empty()) all.push_back(&widened);
    if (all.empty()) return;
    std::optional<at::Tensor> flag;
    if (g.found_inf.defined()) flag = g.found_inf.to(all.front()->params.front().device());
    for (Lists* lists : all) {
      if (flag) {
        at::_foreach_add_(lists->steps, (1 - *flag).reshape({}));  // step counts move only if taken
      } else {
        at::_foreach_add_(lists->steps, 1);
      }
    }
    const auto [beta1, beta2] = options.betas();
    auto kernel = [&](at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps) {
      if constexpr (std::is_same_v<Options, torch::optim::AdamWOptions>) {
        at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options.lr(), beta1,
                          beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                          /*maximize=*/false, /*grad_scale=*/std::nullopt, flag);
      } else {
        at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options.lr(), beta1,
                         beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                         /*maximize=*/false, /*grad_scale=*/std::nullopt, flag);
      }
    };
    for (auto& [dtype, l] : direct) kernel(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.max_exp_avg_sqs, l.steps);
    if (widened.params.empty()) return;
    const std::vector<WideColumn> columns = {
        {&widened.params, true}, {&widened.grads}, {&widened.exp_avgs, true},
        {&widened.exp_avg_sqs, true, /*non_negative=*/true}, {&widened.max_exp_avg_sqs, true, true},
        {&widened.steps, false, false, /*whole=*/true}};
#ifdef AMP_WITH_CUDA_KERNELS
    // On CUDA one kernel decodes, steps and codes back every slice.
    if (const auto slices = pieces_in_place(columns, widened.keys, *g.precision); !slices.empty()) {
      detail::adam_on_cuda(slices, {options.lr(), beta1, beta2, options.weight_decay(), options.eps(),
                                    std::is_same_v<Options, torch::optim::AdamWOptions>, options.amsgrad(),
                                    flag.value_or(at::Tensor())});
      return;
    }
#endif
    step_widened(columns, widened.keys, *g.precision,
                 [&](const std::vector<std::vector<at::Tensor>>& w) { kernel(w[0], w[1], w[2], w[3], w[4], w[5]); });
  }
};

}  // namespace

const FusedKernel& Fusable<torch::optim::Adam>::kernel() {
  static const AdamKernel<torch::optim::AdamOptions, torch::optim::AdamParamState> adam;
  return adam;
}

const FusedKernel& Fusable<torch::optim::AdamW>::kernel() {
  static const AdamKernel<torch::optim::AdamWOptions, torch::optim::AdamWParamState> adamw;
  return adamw;
}

}  // namespace amp::optim::internal
