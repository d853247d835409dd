// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// One-file checkpoints of a mixed-precision run (models, optimizers, amp),
/// and float32 weights for inference without amp.
///
/// ```
///   amp::save_checkpoint("run.pt", {model}, {optimizer});
///   ...  // later, after amp::initialize with the same options:
///   amp::load_checkpoint("run.pt", {model}, {optimizer});
///
///   amp::save_fp32_weights(model, "model.pt");  // torch::load(fp32_model, "model.pt") anywhere
/// ```
///
/// The program's own torch::save / torch::load of models and optimizers work
/// too (initialize.h): at O2/O5 the models hold their float32 master weights
/// between iterations, so torch::save(model, ...) writes float32 there. These
/// functions add amp's loss scalers, write float32 at every level, and load
/// all-or-nothing.
///
/// The checkpoint file holds "model<i>" (each model's weights in
/// torch::nn::Module's own archive layout and in float32: master weights as
/// they are, other low-precision tensors widened exactly, so an fp32 model
/// loads them with model->load(archive)), "optimizer<i>" (the optimizer's own
/// archive) and "amp" (amp::save_state). Resuming continues bit-identically.
///
/// With Options::data_parallel the ranks hold the same values and rank 0
/// writes the file; with data_parallel.shard every rank must call the save
/// functions (they gather the whole masters and optimizer state, written as
/// one process writes them) and load_checkpoint gives each rank its part, at
/// any world size (distributed.h).
///
/// Files are written atomically: into a folder `.<name>.partial.<pid>` beside
/// `path`, then renamed over it, so a process killed mid-write leaves the
/// checkpoint that was there before (or none) - never a torn one - and a
/// reader never sees half a file. (A killed writer's folder stays behind.)
///
/// Errors (c10::Error): amp is not initialized (save_fp32_weights works
/// without amp); a null model or optimizer; the file is missing, truncated or
/// corrupt; a checkpoint in a newer format than this amp reads (written by a
/// newer amp; the checkpoint and its amp state carry their format, as state.h
/// says); an entry is missing or has another shape or kind of dtype; a
/// different number of models or optimizers; any error of load_state
/// (state.h) or of an optimizer's load (a state tensor that does not fit its
/// parameter, a numeric option that is not a finite float32 value). Loading
/// is all-or-nothing: on any error models, optimizers and loss scalers are
/// exactly as before the call.
#pragma once

#include <amp/internal/refs.h>

#include <string>

namespace amp {

/// Writes `models`, `optimizers` and amp's state to the one file `path`.
/// `models` and `optimizers` in braces or as std::vectors (internal/refs.h).
void save_checkpoint(const std::string& path, const internal::ModelRefs& models, const internal::OptimizerRefs& optimizers);
/// Loads a file save_checkpoint wrote into `models`, `optimizers` and amp's
/// state, all-or-nothing; `models` and `optimizers` as for save_checkpoint.
void load_checkpoint(const std::string& path, const internal::ModelRefs& models, const internal::OptimizerRefs& optimizers);

/// Writes `model`'s parameters and buffers in float32, in the layout
/// torch::save(model, path) writes, for a float32 copy of the model to load
/// with torch::load - no amp needed there.
void save_fp32_weights(internal::ModelRef model, const std::string& path);

}  // namespace amp
