// SPDX-License-Identifier: BSD-3-Clause
// Private: the fused inf/NaN check and unscale of a set of gradients, one
// at::_amp_foreach_non_finite_check_and_unscale_ per (device, dtype).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace amp::detail {

// Multiplies `grads` by `inv_scale` in place and makes `found_inf` (a
// 1-element float32 tensor) positive if any value is inf or NaN. Gradients on
// another device than `found_inf` are checked there and folded in. Sparse
// gradients have their values unscaled; a float16 one that is not coalesced
// also has its coalesced sums checked, as GradScaler does.
void non_finite_check_and_unscale(const std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                                  const at::Tensor& inv_scale);

// The same for gradients of one device and dtype that ATen's kernel does not
// cover there (bfloat16 on CUDA): the check from each gradient's largest
// magnitude, the unscale as one multiply. Bit-identical to ATen's kernel.
void check_and_unscale_by_max(const std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                              const at::Tensor& inv_scale);

}  // namespace amp::detail
