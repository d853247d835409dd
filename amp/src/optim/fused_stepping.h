// SPDX-License-Identifier: BSD-3-Clause
// Private: what amp::optim::FusedAdam, FusedAdamW and FusedSGD (fused.h)
// share around their kernels (fused_kernel.h): whether the kernels apply,
// settling a step, and the per-parameter step counts kept on the device.
//
// The algorithm and the state are LibTorch's (torch/optim/adam.cpp,
// adamw.cpp, sgd.cpp): AdamParamState / AdamWParamState / SGDParamState in
// the optimizer's own state map. A step creates the state LibTorch would
// create and runs the kernel once per parameter group. Kernels that count
// steps read counts kept on the device; the host counts in the state
// advance when the step is known to be taken (settle).
#pragma once

#include <amp/fused.h>

#include "optim/fused_kernel.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <unordered_map>
#include <vector>

namespace amp::optim::internal {

class FusedStepping {
 public:
  using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;

  explicit FusedStepping(const FusedKernel& kernel) : kernel_(kernel) {}

  // Whether the kernels can step `optimizer` now: every gradient dense,
  // contiguous and of its parameter's dtype, float32 or float64 (or
  // bfloat16 stepped widened), every parameter on one CPU or CUDA device,
  // and state of the same kind, in state_dtype_of's dtype (packed where
  // that is uint8).
  bool suits(const torch::optim::Optimizer& optimizer, const UpdatePrecision* precision) const;
  // The same for one parameter of `group`, its gradient set.
  bool suits_parameter(const torch::optim::Optimizer& optimizer, const torch::optim::OptimizerParamGroup& group,
                       const at::Tensor& param, const UpdatePrecision* precision) const;
  // Steps the parameters with gradients, skipping on the device when
  // `found_inf` (1 element, exactly 0 or 1; undefined: never) is 1.
  FusedAttempt step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf,
                    const UpdatePrecision* precision);
  // Steps one parameter, the `key`th of the optimizer's, in its group
  // `group`, as step() would within the whole step whose rounding step
  // `precision` carries (a step applied during backward, parameter by
  // parameter). Never skips.
  FusedAttempt step_parameter(torch::optim::Optimizer& optimizer, size_t group, uint64_t key,
                              const at::Tensor& param, const UpdatePrecision* precision);
  // The outcome of `attempt`: counts its step, or drops the state it created.
  void settle(const FusedAttempt& attempt, bool skipped, StateMap& state);
  // Whether a step now could be captured in a CUDA graph: every parameter
  // with a gradient has its state and (Adam) its device step count, so the
  // step allocates nothing whose first values a replay would write again.
  bool holds_all_state(const torch::optim::Optimizer& optimizer) const;
  // Sets the state's host step counts (Adam's `step`) to the device's, which
  // count every step taken, replayed ones included. One host read.
  void adopt_device_counts(StateMap& state);
  // Forgets the device step counts (the state was loaded or stepped by
  // LibTorch's own step); they are rebuilt from the state.
  void reset() { device_steps_.clear(); }

 private:
  void run_kernel(torch::optim::Optimizer& optimizer, torch::optim::OptimizerParamGroup& group,
                  const std::vector<at::Tensor>& params, const std::vector<uint64_t>& keys, const at::Tensor& found_inf,
                  const UpdatePrecision* precision, FusedAttempt& attempt);

  const FusedKernel& kernel_;
  std::unordered_map<void*, at::Tensor> device_steps_;  // kernels that count steps
};

}  // namespace amp::optim::internal
