// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Saving and restoring amp's own state with LibTorch serialization.
///
/// amp's state is every loss scaler (scale, growth tracker, hysteresis
/// tracker) plus the opt level and num_losses it was made with, and with
/// stochastic rounding (O6) or 8-bit optimizer state the rounding's seed and
/// step count, so a resumed run draws what the uninterrupted one would (a run
/// keeping its state in float32 drops 8-bit state's), and with the fp8 property
/// every float8 GEMM's scales and amax histories, by its weight's name, so a
/// resumed run scales as the uninterrupted one would. Master weights (O2/O5) travel
/// with the optimizer: torch::save(*optimizer) includes them.
///
/// Resume recipe (as in Apex): initialize with the same options, then load the
/// model, the optimizer and amp's state.
///
/// ```
///   torch::serialize::OutputArchive archive;
///   amp::save_state(archive);
///   archive.save_to("amp.pt");
///   ...
///   std::tie(model, optimizer) = amp::initialize(model, optimizer, options);
///   torch::serialize::InputArchive in;
///   in.load_from("amp.pt");
///   amp::load_state(in);
/// ```
///
/// The state carries its format version (entry `amp_format`): every older
/// format loads (state saved by amp 0.1.0 has none: format 1), and state
/// saved by a newer amp, in a format this one does not know, is refused.
///
/// Errors (c10::Error; on error nothing is changed): amp is not initialized;
/// state in a newer format ("written by a newer amp"); a missing or
/// mistyped entry; a different num_losses or opt level than the
/// live initialization; static/dynamic scaling mismatch; O6's rounding entry
/// when amp runs without stochastic rounding, or one that is not a seed and
/// a step count >= 0; fp8 scales when amp runs without fp8, for a weight
/// that is no parameter of initialize's models, or with an amax history of
/// another length than Options::fp8_scaling's.
#pragma once

#include <torch/serialize/archive.h>

namespace amp {

/// Writes amp's state (above) into `archive`.
void save_state(torch::serialize::OutputArchive& archive);
/// Restores amp's state from an archive save_state wrote, all-or-nothing.
void load_state(torch::serialize::InputArchive& archive);

}  // namespace amp
