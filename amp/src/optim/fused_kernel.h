// SPDX-License-Identifier: BSD-3-Clause
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
#include "optim/widened_step_kernels.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <vector>

namespace amp::optim::internal {

// How amp's session keeps what the kernels step. O6
// (Properties::stochastic_rounding) steps bfloat16 parameters in float32
// copies, a chunk at a time, and rounds the results - and a bfloat16 state -
// back stochastically; an 8-bit state (Properties::optimizer_state_dtype
// uint8, eight_bit_state.h) is unpacked into float32 copies the same way
// and packed again, rounded stochastically from the same streams.
struct UpdatePrecision {
  detail::StochasticRounding* rounder = nullptr;  // the session's rounding streams
  bool rounds_weights = false;                    // O6: bfloat16 parameters rounded
  c10::ScalarType state_dtype = c10::kFloat;      // Properties::optimizer_state_dtype
  int64_t step = 0;                               // the rounding step (rounder->next_step())
};

// What one fused step did, for settling it once its outcome is known.
struct FusedAttempt {
  std::vector<void*> stepped;  // parameters whose step counts advance if taken
  std::vector<void*> created;  // state entries this step created
};

// One group's step, as a kernel sees it.
struct GroupStep {
  torch::optim::OptimizerParamGroup& group;
  // The group's parameters this step considers (all of them, or those a
  // step during backward applies now), and each one's rounding key: its
  // position among the optimizer's parameters.
  const std::vector<at::Tensor>& params;
  const std::vector<uint64_t>& keys;
  ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>& state;
  const at::Tensor& found_inf;  // 1 element, 0 or 1 (undefined: never)
  const UpdatePrecision* precision;  // null: parameters and state stepped in their dtype
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

// The dtype of the state a step creates for `param` (uint8: packed 8-bit).
c10::ScalarType state_dtype_of(const at::Tensor& param, const UpdatePrecision* precision);
// Whether `param` is stepped through step_widened: a bfloat16 weight O6
// rounds, or one whose state is packed in 8 bits.
bool steps_widened(const at::Tensor& param, const UpdatePrecision* precision);
// A new state tensor for `param` holding zeros, in state_dtype_of's dtype.
at::Tensor zero_state(const at::Tensor& param, const UpdatePrecision* precision, bool non_negative);

// One list of step_widened's tensors (parallel to the parameters).
struct WideColumn {
  const std::vector<at::Tensor>* tensors;
  bool written = false;       // the kernel writes it: its results go back
  bool non_negative = false;  // packed 8-bit state: the code it is kept in
  bool whole = false;         // one tensor per parameter, passed whole with each slice of it (step counts)
};

// Steps `columns` (column 0 the parameters, `keys` their rounding keys)
// through `kernel` in float32, a chunk of at most 2^20 values at a time
// (a larger tensor in slices of its flattened values, each slice a tensor
// of the kernel's lists): bfloat16 tensors are widened and packed 8-bit
// state unpacked, float32 ones passed as they are; afterwards the written
// columns' bfloat16 tensors take the kernel's results rounded
// stochastically, and their packed state the results packed again, each
// slice from its own stream of `precision`'s step. Empty columns stay
// empty.
void step_widened(const std::vector<WideColumn>& columns, const std::vector<uint64_t>& keys,
                  const UpdatePrecision& precision,
                  const std::function<void(const std::vector<std::vector<at::Tensor>>&)>& kernel);

// step_widened's slices of `columns`, for a fused CUDA kernel that steps
// them in place (widened_step_kernels.h): each slice's piece of every
// column (the whole tensor of a `whole` one), a written bfloat16 or packed
// piece with the stream step_widened would round or code it from. Empty
// where that kernel cannot take them all: the build has no CUDA kernels,
// widened_steps_fused is off, or a tensor is off the parameters' device, not
// contiguous, or of another dtype.
std::vector<std::vector<detail::CudaWidePiece>> pieces_in_place(const std::vector<WideColumn>& columns,
                                                                 const std::vector<uint64_t>& keys,
                                                                 const UpdatePrecision& precision);

}  // namespace amp::optim::internal
