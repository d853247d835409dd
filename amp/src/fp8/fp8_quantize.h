// SPDX-License-Identifier: BSD-3-Clause
// Private: one operand's float8 quantization fused into two CUDA kernels
// (fp8_quantize.cu, launched by fp8_quantize.cpp; compiled where the build
// has a CUDA compiler, which defines AMP_WITH_FP8_KERNELS): a reduction for
// the amax, then one pass that derives the scale from it on the device,
// scales, saturates and rounds every element, and writes the inverse scale
// and the amax history - where Fp8Scaler's ATen path takes a dozen
// launches, each a pass over the tensor or an op on one element. The values
// are that path's, bit for bit (tested side by side on a GPU): the same
// float32 arithmetic in the same order, and c10's own float8 rounding.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <utility>

namespace amp::detail {

// What the quantization reads and writes of an Fp8Scaler (fp8_scaler.h).
struct Fp8QuantizeState {
  at::Tensor scale;    // float32 [1]: the delayed scale
  at::Tensor updated;  // float32 [1]: 1 once an update set `scale` from a history
  at::Tensor current;  // float32 [1]: this iteration's amax so far (delayed scaling)
  bool delayed = false;
  double factor = 0;         // fp8_max / 2^margin
  float smallest_amax = 0;   // the least amax whose own scale is used
  double fp8_max = 0;
  at::ScalarType format = at::kFloat8_e4m3fn;
};

// Whether the kernels were built for device `index`'s architecture (SASS
// for it, or PTX it compiles; AMP_CUDA_ARCHITECTURES chooses them): asked of
// the CUDA runtime once per device. -1: the current device.
bool fp8_kernels_run_on(c10::DeviceIndex index);

// Whether `x` can take the fused path: a contiguous, non-empty float32,
// bfloat16 or float16 CUDA tensor, on a device the kernels were built for.
bool fused_fp8_quantize_applies(const at::Tensor& x);
// x scaled, saturated and rounded to state.format, and the inverse scale (a
// 0-dim float32 tensor), as Fp8Scaler::quantize's ATen path computes them;
// with delayed scaling x's amax joins state.current. No host sync.
std::pair<at::Tensor, at::Tensor> fused_fp8_quantize(const at::Tensor& x, const Fp8QuantizeState& state);
// The same of a matrix x [rows, cols], and its transpose [cols, rows]
// contiguous (the layout _scaled_mm takes a column-major operand in),
// written by the pass that scales and casts: values, inverse, transpose.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_fp8_quantize_transposed(const at::Tensor& x,
                                                                            const Fp8QuantizeState& state);

// Whether `m` can take fused_fp8_transpose: a contiguous, non-empty float8
// matrix on CUDA, on a device the kernels were built for.
bool fused_fp8_transpose_applies(const at::Tensor& m);
// m.t().contiguous() in one tiled pass (ATen's strided copy reads a byte of
// each 32-byte sector it loads when it transposes float8).
at::Tensor fused_fp8_transpose(const at::Tensor& m);

}  // namespace amp::detail
