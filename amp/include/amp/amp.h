// amp: Apex-style automatic mixed precision for LibTorch.
//
// Three edits to an existing training loop, which keeps holding its objects
// as it does:
//
//   #include <amp/amp.h>
//
//   Net model;
//   torch::optim::Adam optimizer(model.parameters(), 1e-3);
//   amp::initialize(model, optimizer, amp::O1);
//   for (auto& batch : *loader) {
//     optimizer.zero_grad();
//     auto loss = torch::nll_loss(model.forward(batch.data), batch.target);
//     {
//       amp::scale_loss scaled(loss, optimizer);
//       scaled.backward();
//     }
//     optimizer.step();
//   }
//
// Headers: initialize.h (the front door, Handle, deinitialize), refs.h (how
// models and optimizers are passed), options.h and opt_levels.h (O0-O5 and
// overrides), scale_loss.h (the backward guard), optimizer.h (skipped steps,
// master params), fused.h (fused Adam, AdamW and SGD that skip on the
// device), cast_policy.h (op tables and user registration), casting_scope.h
// (disable_casts, enable_casts, cast_dtype, disable_cast_cache,
// with_current_casts), custom_function.h (custom_fwd / custom_bwd for
// autograd functions), cast_cache.h, hardware.h (what the CPU computes
// natively), log.h (amp's events: skipped steps, warnings), loss_scaler.h,
// memory.h (allocator bytes, now and at the peak), model_conversion.h, op_stats.h, state.h and
// checkpoint.h (saving and resuming), distributed.h (data-parallel ranks),
// overflow.h (where a skipped step's inf/NaN came from), recompute.h
// (activation recomputation under amp's casts).
// Not included here: testing.h (host_syncs and test hooks, for benchmarks
// and tests), alignment.h (layers whose GEMM shapes miss the hardware's
// multiples, a diagnostic), measured_policy.h (the table behind
// Options::measured_policy); internal/ holds what the headers need but
// programs do not.
#pragma once

#include <amp/cast_cache.h>
#include <amp/checkpoint.h>
#include <amp/cast_policy.h>
#include <amp/casting_scope.h>
#include <amp/custom_function.h>
#include <amp/distributed.h>
#include <amp/fused.h>
#include <amp/hardware.h>
#include <amp/initialize.h>
#include <amp/log.h>
#include <amp/loss_scaler.h>
#include <amp/memory.h>
#include <amp/model_conversion.h>
#include <amp/op_stats.h>
#include <amp/opt_levels.h>
#include <amp/optimizer.h>
#include <amp/options.h>
#include <amp/overflow.h>
#include <amp/recompute.h>
#include <amp/refs.h>
#include <amp/scale_loss.h>
#include <amp/state.h>
#include <amp/telemetry.h>
