// Private: the process-wide cache of low-precision copies of fp32 weights.
#pragma once

#include <ATen/core/Tensor.h>

namespace amp::detail {

// True when a cast of `t` to `to` may be served from the cache: an fp32 leaf
// that requires grad (a weight), or a view of a contiguous one, going to a
// low-precision dtype, outside InferenceMode.
bool is_cacheable(const at::Tensor& t, at::ScalarType to);

// The cached copy of weight `t` in dtype `to`, casting on a miss (or when the
// entry is stale: `t` changed in place, or the copy lacks grad history that
// grad mode now needs).
at::Tensor cached_cast(const at::Tensor& t, at::ScalarType to);

}  // namespace amp::detail
