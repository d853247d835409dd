// SPDX-License-Identifier: BSD-3-Clause
// Private: the process-wide cache of low-precision copies of fp32 weights.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace amp::detail {

// True when a cast of `t` to `to` may be served from the cache: an fp32 leaf
// that requires grad (a weight), or a view of a contiguous one, going to a
// low-precision dtype, outside InferenceMode.
bool is_cacheable(const at::Tensor& t, at::ScalarType to);

// The cached copy of weight `t` in dtype `to`, casting on a miss (or when the
// entry is stale: `t` changed in place, or the copy lacks grad history that
// grad mode now needs).
at::Tensor cached_cast(const at::Tensor& t, at::ScalarType to);

// One entry of the cache: weight `weight`'s copy in dtype `to` - or, where
// `transposed`, the copy of its transpose (the form a cast first met:
// nn::Linear's weight.t()); casts of the other form are its transpose.
struct CachedCopy {
  at::Tensor weight;
  at::ScalarType to;
  at::Tensor copy;
  bool transposed = false;
};
// What casts on this thread would meet, in no particular order: the
// entries whose weights still live, or what a ServeCopies scope serves.
std::vector<CachedCopy> cached_copies();

// RAII, on this thread: casts of each `copies[i].weight` to its dtype are
// served `served[i]` instead, in copies[i]'s form (a recomputed block's rerun, which must meet
// the copies its forward met). Scopes do not nest.
class [[nodiscard]] ServeCopies {
 public:
  ServeCopies(const std::vector<CachedCopy>& copies, const std::vector<at::Tensor>& served);
  ~ServeCopies();
  ServeCopies(const ServeCopies&) = delete;
  ServeCopies& operator=(const ServeCopies&) = delete;
};

}  // namespace amp::detail
