// Private: one fused optimizer's kernel calls - what differs between
// amp::optim::FusedAdam, FusedAdamW, FusedSGD (fused.h). FusedStepping
// (fused_stepping.h) does the rest for all of them: checking that the
// kernels apply, settling a step once its outcome is known, the device step
// counts. A new fused optimizer is a FusedKernel in a file of its own (as
// fused_adam_kernel.cpp, fused_sgd_kernel.cpp), its Fusable trait in
// fused.h returning it, and its tests.
#pragma once

#include <amp/fused.h>

#include "optim/stochastic_rounding.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <vector>

namespace amp::optim::internal {

// O6 (Properties::stochastic_rounding): bfloat16 parameters are stepped in
// float32 copies, a chunk at a time, and the results - and, with a
// bfloat16 state, the state - rounded back stochastically.
struct UpdateRounding {
  detail::StochasticRounding* rounder = nullptr;
  c10::ScalarType state_dtype = c10::kFloat;
};

// What one fused step did, for settling it once its outcome is known.
struct FusedAttempt {
  std::vector<void*> stepped;  // parameters whose step counts advance if taken
  std::vector<void*> created;  // state entries this step created
};

// One group's step, as a kernel sees it.
struct GroupStep {
  torch::optim::OptimizerParamGroup& group;
  ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>& state;
  const at::Tensor& found_inf;  // 1 element, 0 or 1 (undefined: never)
  const UpdateRounding* rounding;  // null: parameters stepped in their dtype
  FusedAttempt& attempt;
  // The device step count of parameter `key` (a float32 scalar next to
  // `param`), created from the state's host count `host` the first time.
  std::function<at::Tensor&(void* key, int64_t host, const at::Tensor& param)> device_step;
};

class FusedKernel {
 public:
  virtual ~FusedKernel() = default;
  // Whether the state tensor at `index` of detail::state_tensors' list must
  // be present for a group with `options` (Adam's third: with amsgrad).
  virtual bool needs_state(const torch::optim::OptimizerOptions& options, size_t index) const = 0;
  // Whether float16 / bfloat16 parameters on the CPU are stepped by the
  // kernel (ATen 2.11's CPU _fused_sgd_ leaves those of 64 or more elements
  // unchanged: LibTorch's step runs instead).
  virtual bool steps_low_precision_on_cpu() const { return true; }
  // Whether the kernel reads step counts kept on the device (Adam's).
  virtual bool counts_steps() const { return false; }
  // Steps the group's parameters that have gradients, creating the state
  // LibTorch's step would create (recorded in the attempt), skipping on the
  // device when found_inf is 1.
  virtual void step(GroupStep& step) const = 0;
};

// The dtype of the state a step creates for `param`.
c10::ScalarType state_dtype_of(const at::Tensor& param, const UpdateRounding* rounding);

// Steps `columns` (parallel lists; column 0 the parameters) through
// `kernel` in float32, a chunk at a time: bfloat16 tensors are widened,
// float32 ones passed as they are; afterwards the bfloat16 tensors of the
// columns the kernel writes (`written`) take its results, rounded
// stochastically. Empty columns stay empty.
void step_widened(const std::vector<const std::vector<at::Tensor>*>& columns, const std::vector<bool>& written,
                  detail::StochasticRounding& rounder,
                  const std::function<void(const std::vector<std::vector<at::Tensor>>&)>& kernel);

}  // namespace amp::optim::internal
