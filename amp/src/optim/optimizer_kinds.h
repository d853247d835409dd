// SPDX-License-Identifier: BSD-3-Clause
// Private: what amp knows about LibTorch's optimizer classes (SGD, Adam,
// AdamW, Adagrad, RMSprop) and amp's fused ones - the one place that names
// them. A new optimizer kind is a row in each function here.
#pragma once

#include <amp/fused.h>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace amp::detail {

// amp's fused optimizer behind `optimizer`, or null.
optim::internal::Fused* fused_optimizer(torch::optim::Optimizer& optimizer);

// The epsilon of Adam, AdamW, RMSprop and Adagrad options.
std::optional<double> optimizer_eps(const torch::optim::OptimizerOptions& options);

// A per-parameter state tensor, and whether the state must hold it.
struct StateTensor {
  const char* name;
  at::Tensor value;
  bool required;
};
// The state tensors of a known optimizer's parameter state (empty for
// others); `step` receives its step count where it keeps one.
std::vector<StateTensor> state_tensors(const torch::optim::OptimizerParamState& state, int64_t& step);

// Sets the step count of a state that keeps one (others are left alone).
void set_step_count(torch::optim::OptimizerParamState& state, int64_t steps);
// Counts one more step taken in a state that keeps a step count.
void count_step(torch::optim::OptimizerParamState& state);

// Parameters this small keep float32 state under 8-bit state, as
// bitsandbytes' min_8bit_size: a block's scale and padding would cost more
// than the bytes they save.
inline constexpr int64_t kMinPackedElements = 4096;

// The dtype of the state amp's fused optimizers keep for `param`, given
// Properties::optimizer_state_dtype `chosen` (nullopt: the session neither
// rounds nor packs): with uint8, float32 and bfloat16 parameters of at
// least kMinPackedElements elements keep theirs packed in 8 bits
// (eight_bit_state.h), smaller ones in float32; float32 or bfloat16 for
// O6's bfloat16 ones; any other its own dtype.
inline at::ScalarType kept_state_dtype(const at::Tensor& param, std::optional<at::ScalarType> chosen) {
  const at::ScalarType dtype = param.scalar_type();
  if (chosen == at::kByte) {
    if (dtype != at::kFloat && dtype != at::kBFloat16) return dtype;
    return param.numel() >= kMinPackedElements ? at::kByte : at::kFloat;
  }
  return chosen && dtype == at::kBFloat16 ? *chosen : dtype;
}

// Whether the state tensor `name` never holds negative values (Adam's
// second moments, Adagrad's sums, RMSprop's square averages): 8-bit state
// keeps it in the non-negative code.
bool non_negative_state(const char* name);

// The numeric options of a known optimizer (empty for others).
std::vector<std::pair<const char*, double>> numeric_options(const torch::optim::OptimizerOptions& options);

}  // namespace amp::detail

namespace amp::detail {

// A fresh parameter state of the kind `options` belongs to (a known
// optimizer's), holding `values` by their state_tensors names (others stay
// undefined) and, where it keeps one, the step count `step`. Null for other
// kinds.
std::unique_ptr<torch::optim::OptimizerParamState> make_state(const torch::optim::OptimizerOptions& options,
                                                              const std::vector<StateTensor>& values, int64_t step);

}  // namespace amp::detail
