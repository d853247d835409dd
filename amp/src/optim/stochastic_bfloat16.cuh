// SPDX-License-Identifier: BSD-3-Clause
// Private, CUDA only: one float32 value rounded stochastically to bfloat16
// as stochastic_rounding.cpp's ATen ops round it (the rounding kernel,
// rounding_kernel.cu, and the fused step, widened_update_kernels.cu, share it).
#pragma once

#include <torch/headeronly/util/BFloat16.h>

#include <cstdint>

namespace amp::detail::widened_step {

// `x` plus `noise` (16 bits) below bfloat16's cut, truncated; NaN stays NaN.
// The conversion is c10's, as the ATen ops' copy into bfloat16.
__device__ inline uint16_t stochastic_bfloat16(float x, uint32_t noise) {
  const uint32_t bits = __float_as_uint(x);
  const float rounded = x != x ? __int_as_float(0x7FC00000)  // masked_fill's quiet NaN
                               : __uint_as_float((bits + noise) & 0xFFFF0000u);
  return c10::BFloat16(rounded).x;
}

}  // namespace amp::detail::widened_step
