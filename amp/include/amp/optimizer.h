// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// What amp knows about an optimizer passed to amp::initialize: its skipped
/// steps, and the tensors it steps.
///
/// ```
///   optimizer.step();
///   if (!amp::last_step_skipped(optimizer)) scheduler.step();
/// ```
///
/// amp never replaces the program's optimizer (initialize.h): its parameter
/// groups hold the model's parameters, which at O2/O5 are the float32 master
/// weights between iterations, so clipping model->parameters() or the
/// optimizer's own parameters clips what is stepped. master_params() is
/// Apex's name for them. With Options::data_parallel.shard the groups hold
/// this rank's float32 pieces instead (distributed.h): clip with
/// clip_grad_norm below.
///
/// "Skipped" means a gradient overflow left the optimizer nothing to step:
/// for LibTorch's optimizers the guard decided it (an overflow discards the
/// gradients, so their step() changes nothing); for amp's fused optimizers
/// (fused.h) the device decided it inside step(). After a fused step on a GPU
/// these functions wait for the device's decision (a host sync, counted by
/// amp::host_syncs()); ask only where the answer is needed.
///
/// Errors (c10::Error): amp is not initialized; an optimizer that was not
/// passed to the live amp::initialize.
#pragma once

#include <amp/internal/refs.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace amp {

/// The tensors `optimizer` steps: its parameter groups' parameters.
std::vector<at::Tensor> master_params(internal::OptimizerRef optimizer);

/// Steps of `optimizer` skipped after gradient overflows so far.
int64_t skipped_steps(internal::OptimizerRef optimizer);

/// Clips the gradients of `optimizer`'s parameters to a global 2-norm of at
/// most `max_norm` (as torch::nn::utils::clip_grad_norm_, coefficient
/// max_norm / (norm + 1e-6), at most 1), and returns the norm (a 0-dim
/// float32 tensor; no host read). With Options::data_parallel.shard the norm
/// spans every rank's shard (a collective: every rank calls it). Call it
/// after the guard, or inside it after unscale(). Errors: max_norm not finite
/// and > 0; the optimizer accumulating (delay_unscale); step_in_backward
/// (backward applied and freed the gradients).
at::Tensor clip_grad_norm(internal::OptimizerRef optimizer, double max_norm);

/// Whether the gradients of the latest guard over `optimizer` overflowed, so
/// that its next (or, for a fused optimizer, latest) step() was skipped.
/// Advance an LR scheduler only when it was not.
bool last_step_skipped(internal::OptimizerRef optimizer);

}  // namespace amp
