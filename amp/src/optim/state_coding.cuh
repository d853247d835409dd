// SPDX-License-Identifier: BSD-3-Clause
// Private, CUDA only: one value of a packed 8-bit state row (eight_bit_state.h)
// coded and decoded by one thread, a row of 256 values by a block of 256
// threads, as the ATen ops of eight_bit_state.cpp compute them, in the same
// float32 operations, so the bytes are theirs. The coding kernels
// (state_coding_kernel.cu) and the fused step (widened_update_kernels.cu) share it.
#pragma once

#include "optim/aten_draws.cuh"
#include "optim/widened_step_launch.h"

#include <cstdint>

namespace amp::detail::widened_step::coding {

constexpr int kBlock = 256;       // values a packed row codes (eight_bit_state.h's kStateBlock)
constexpr int kRow = kBlock + 1;  // its codes, then its exponent
constexpr int kMinExponent = -126, kMaxExponent = 127, kNonFiniteBlock = -128;
static_assert(kBlock == kThreads);

// The largest of the block's `v` (every thread's answer), through `scratch`.
__device__ inline float block_max(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();  // scratch's last readers are done
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kBlock / 32; ++w) v = fmaxf(v, scratch[w]);
  return v;
}

// Codes this thread's value `x` (0 past the tensor's values: the last row
// is padded with zeros) into `out`, its block's row, with `book`. The noise
// of a stochastic coding is at::rand's draw for value `index` of the
// [rows, 256] padded values. Every thread of the block calls it.
__device__ inline void pack_value(const CodeBook& book, const StateNoise& noise, float x, int64_t index,
                                  uint8_t* out, float* scratch) {
  const bool non_finite = __syncthreads_or(!isfinite(x));
  // The smallest power of two holding the row's maximum.
  int exponent = 0;
  const float mantissa = frexpf(block_max(fabsf(x), scratch), &exponent);
  int e = min(max(exponent - (mantissa == 0.5f ? 1 : 0), kMinExponent), kMaxExponent);
  const float y = fminf(fmaxf(__fdiv_rn(x, __int_as_float((e + 127) << 23)), book.zero == 0 ? 0.0f : -1.0f), 1.0f);
  // The neighbouring codes a <= y <= b: bucketize(right) - 1, clamped.
  int first = 0, count = book.last + 1;  // upper bound: the first entry above y
  while (count > 0) {
    const int half = count / 2;
    if (book.table[first + half] <= y) {
      first += half + 1;
      count -= half + 1;
    } else {
      count = half;
    }
  }
  const int lo = min(max(first - 1, 0), book.last), hi = min(lo + 1, book.last);
  const float a = book.table[lo], b = book.table[hi];
  const bool up = noise.stochastic
                      ? __fmul_rn(aten_draws::uniform(noise.seed, index, noise.stride), __fsub_rn(b, a)) < __fsub_rn(y, a)
                      : __fsub_rn(y, a) > __fsub_rn(b, y);
  int code = lo + (up ? 1 : 0);
  // A row whose maximum rounded down onto 0.5 is coded one exponent down.
  const bool halve = block_max(fabsf(up ? b : a), scratch) == 0.5f && e > kMinExponent;
  if (halve) code += (book.zero == 0 ? (code > 0) : (code > book.zero) - (code < book.zero)) * book.steps;
  if (halve) e -= 1;
  out[threadIdx.x] = non_finite ? 0 : static_cast<uint8_t>(code);
  if (threadIdx.x == 0) out[kBlock] = static_cast<uint8_t>(static_cast<int8_t>(non_finite ? kNonFiniteBlock : e));
}

// This thread's value of `row` (a packed row): unpack_by_aten_ops'
// table[code] * 2^exponent, NaN for a non-finite row's. A code past the
// table (damaged state, which the CPU refuses) decodes as NaN: a kernel
// cannot raise an error without the host waiting for it.
__device__ inline float unpack_value(const CodeBook& book, const uint8_t* row) {
  const int code = row[threadIdx.x], e = static_cast<int8_t>(row[kBlock]);
  const float nan = __int_as_float(0x7FC00000);  // masked_fill's quiet NaN
  const float scale = e == kNonFiniteBlock ? nan : __int_as_float((max(e, kMinExponent) + 127) << 23);
  return __fmul_rn(code <= book.last ? book.table[code] : nan, scale);
}

}  // namespace amp::detail::widened_step::coding
