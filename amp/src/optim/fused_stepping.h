// Private: the kernels behind amp::optim::FusedAdam, FusedAdamW and FusedSGD
// (fused.h), and the per-parameter step counts they keep on the device.
//
// The algorithm and the state are LibTorch's (torch/optim/adam.cpp,
// adamw.cpp, sgd.cpp): AdamParamState / AdamWParamState / SGDParamState in
// the optimizer's own state map. A step creates the state LibTorch would
// create and runs one kernel call per parameter group. Adam's kernels read
// step counts kept on the device; the host counts in the state advance when
// the step is known to be taken (settle).
#pragma once

#include <amp/fused.h>

#include "optim/stochastic_rounding.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <unordered_map>
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
  std::vector<void*> stepped;  // Adam: parameters whose step counts advance if taken
  std::vector<void*> created;  // state entries this step created
};

class FusedStepping {
 public:
  using Kind = Fused::Kind;
  using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;

  explicit FusedStepping(Kind kind) : kind_(kind) {}

  // Whether the kernels can step `optimizer` now: every gradient dense,
  // contiguous and of its parameter's dtype, float32 or float64 (or
  // bfloat16 with `rounding`), every parameter on one CPU or CUDA device,
  // and state of the same kind, in the parameter's dtype (with `rounding`:
  // in its state dtype).
  bool suits(const torch::optim::Optimizer& optimizer, const UpdateRounding* rounding) const;
  // Steps the parameters with gradients, skipping on the device when
  // `found_inf` (1 element, exactly 0 or 1; undefined: never) is 1.
  FusedAttempt step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf,
                    const UpdateRounding* rounding);
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
  template <class Options, class ParamState>
  void step_adam(torch::optim::OptimizerParamGroup& group, StateMap& state,
                 const at::Tensor& found_inf, const UpdateRounding* rounding, FusedAttempt& attempt);
  void step_sgd(torch::optim::OptimizerParamGroup& group, StateMap& state,
                const at::Tensor& found_inf, const UpdateRounding* rounding, FusedAttempt& attempt);

  Kind kind_;
  std::unordered_map<void*, at::Tensor> device_steps_;  // Adam's step counts
};

}  // namespace amp::optim::internal
