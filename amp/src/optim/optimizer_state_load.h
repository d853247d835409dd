// SPDX-License-Identifier: BSD-3-Clause
// Private: loading an optimizer's state as a transaction. LibTorch's
// Optimizer::load changes state as it reads and accepts state tensors that
// do not fit their parameters (the first step() then fails far from the
// cause); amp loads all-or-nothing and checks the result.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

#include <exception>
#include <functional>
#include <string>

namespace amp::detail {

// The optimizer's state as the bytes of its archive, and back.
std::string state_bytes(const torch::optim::Optimizer& optimizer);
void restore_state_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes);

// The dtype a parameter's state is kept in; null: the parameter's own.
// O6 keeps a bfloat16 parameter's state in optimizer_state_dtype, uint8
// packs it in 8 bits (eight_bit_state.h), and a checkpoint holds it as it
// was kept: a run keeping another dtype (or sharded, whose whole state is
// float32) converts it as it loads.
using StateDtype = std::function<at::ScalarType(const at::Tensor& param)>;

// Loads `archive` into `optimizer`, state tensors converted as
// convert_state does; `before` is its state_bytes, restored on error. Errors
// (c10::Error; the optimizer is unchanged): any error of the optimizer's
// own load, translated; a state tensor that is missing, or whose shape or
// device differs from its parameter's, or whose dtype from `dtype`'s; a
// negative step count; a numeric option (lr, betas, eps, ...) that is not a
// finite float32 value.
void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive,
                          const std::string& before, const StateDtype& dtype = nullptr);

// Converts the floating and packed state tensors to `dtype` (after a load);
// null `dtype`: packed ones to their parameter's dtype.
void convert_state(torch::optim::Optimizer& optimizer, const StateDtype& dtype);

// Checks the loaded state against the parameters (as load_optimizer_state
// does); throws the reason.
void check_state_fits_params(const torch::optim::Optimizer& optimizer, const StateDtype& dtype = nullptr);

// The message of any exception, without C++ frames for c10::Error.
std::string message_of(const std::exception& e);

}  // namespace amp::detail
