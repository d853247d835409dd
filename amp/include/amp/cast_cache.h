// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// The cast cache: an fp32 weight is cast to low precision at most once per
/// iteration.
///
/// Under O1, every lower-precision op casts its fp32 weight arguments. A leaf
/// tensor that requires grad (a parameter) is cast once and the copy reused
/// until the cache is cleared: when a scale_loss guard ends (once per
/// iteration), on clear_cast_cache(), and on deinitialize. A view of a weight
/// (LibTorch's nn::Linear passes weight.t() to addmm) is served as the same
/// view of the weight's cached copy. Activations are never cached. An entry is
/// not reused when
///   - the weight changed in place since the cast (its version counter moved:
///     an optimizer step, w.add_(), w.copy_() under no_grad) - a stale-copy
///     window that both Apex and native autocast leave open;
///   - it was made under no_grad (or in eval) and grad mode is now on, so the
///     copy carries no autograd history;
///   - the weight itself was freed (the key's address may be reused).
///
/// Casts under InferenceMode are never cached.
///
/// What the cache cannot see: writes through w.data() or w.variable_data()
/// (and w.set_data()). Those alias the weight's storage under a fresh version
/// counter, so the weight's own counter does not move. An entry made before
/// such a write keeps serving the old values until the cache is cleared - at
/// the latest when the iteration's guard ends. Code that edits weights that
/// way between forward passes of one iteration (weight averaging, pruning
/// masks applied in an inference loop without guards) calls
/// clear_cast_cache() after the edit, or edits with w.copy_() under
/// torch::NoGradGuard, which the cache sees.
///
/// clear_cast_cache() also clears LibTorch's native autocast cache, used by
/// the native kernels amp leaves in place (aten::_cudnn_rnn on CUDA).
///
/// The cache is process-wide and thread-safe; counters are monotonic, so tests
/// and reports take differences.
#pragma once

#include <cstddef>
#include <cstdint>

namespace amp {

/// amp's cast counters since the process started (monotonic).
struct CastCounts {
  int64_t casts = 0;       ///< tensors cast by amp (cache misses included)
  int64_t cache_hits = 0;  ///< weight casts served from the cache
};

/// The process-wide cast counts so far, summed over every thread.
CastCounts cast_counts();
/// Drops every cached copy (amp's cache and LibTorch's native autocast
/// cache); the next cast of each weight casts afresh.
void clear_cast_cache();
/// The number of cached copies now: one per weight and target dtype.
size_t cast_cache_size();

}  // namespace amp
