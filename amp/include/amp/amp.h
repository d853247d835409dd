// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// amp: Apex-style automatic mixed precision for LibTorch.
///
/// Three edits to an existing training loop, which keeps holding its objects
/// as it does:
///
/// ```
///   #include <amp/amp.h>
///
///   Net model;
///   torch::optim::Adam optimizer(model.parameters(), 1e-3);
///   amp::initialize(model, optimizer, amp::O1);
///   for (auto& batch : *loader) {
///     optimizer.zero_grad();
///     auto loss = torch::nll_loss(model.forward(batch.data), batch.target);
///     {
///       amp::scale_loss scaled(loss, optimizer);
///       scaled.backward();
///     }
///     optimizer.step();
///   }
/// ```
///
/// This header is the core, everything a training loop needs:
/// ```
///   initialize.h   amp::initialize, Handle, deinitialize, is_initialized, properties
///   options.h      Options: the opt level (opt_levels.h: O0-O6, LossScale,
///                  DynamicScaling, PropertyOverrides, Properties, describe) and
///                  amp's own knobs (data_parallel.h: DataParallel)
///   scale_loss.h   the backward guard
///   loss_scaler.h  amp::loss_scaler(loss_id): read or tune a loss's scale
///   optimizer.h    master_params, skipped_steps, last_step_skipped, clip_grad_norm
///   fused.h        amp::optim::FusedAdam, FusedAdamW, FusedSGD: skip on the device
///   state.h        save_state / load_state: amp's own state (Apex's amp.state_dict)
///   checkpoint.h   save_checkpoint / load_checkpoint / save_fp32_weights
///   recompute.h    recompute, recompute_sequential, recompute_in_slices:
///                  activation recomputation
///   version.h      AMP_VERSION_MAJOR/MINOR/PATCH, AMP_VERSION_STRING, amp::version()
/// ```
/// Beside it, each an umbrella of its own:
/// ```
///   casting.h      the cast policies and scopes (register_half_function,
///                  disable_casts, custom_fwd, ...)
///   diagnostics.h  what amp can tell: op and cast counts, overflow provenance,
///                  precision telemetry, memory, the CPU's precision, the log,
///                  the alignment report, the measured policy's table
///   distributed.h  overflow_all_reduce, for programs that average gradients
///                  themselves
///   testing.h      host_syncs and test hooks, for benchmarks and tests
///   linear_cross_entropy.h  linear_cross_entropy: a language model's output
///                  layer and its loss in chunks, never holding the logits
///   selective_recompute.h  amp::Keep: what a recomputed block keeps for its
///                  rerun (its GEMMs' outputs), which computes only the rest
/// ```
/// internal/ holds what these headers need and programs never name.
#pragma once

#include <amp/checkpoint.h>
#include <amp/fused.h>
#include <amp/initialize.h>
#include <amp/loss_scaler.h>
#include <amp/opt_levels.h>
#include <amp/optimizer.h>
#include <amp/options.h>
#include <amp/recompute.h>
#include <amp/scale_loss.h>
#include <amp/state.h>
#include <amp/version.h>

/// \namespace amp
/// Apex-style automatic mixed precision for LibTorch: every name a program
/// uses (amp::internal and amp::detail hold what programs never name).
