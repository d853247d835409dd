// SPDX-License-Identifier: BSD-3-Clause
// Private: the fused float8 quantization's kernels (fp8_quantize.h) as
// fp8_quantize.cu sees them - plain pointers and sizes, without LibTorch's
// headers, which take nvcc many times longer to compile than the kernels.
// fp8_quantize.cpp takes the tensors apart and checks what comes back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace amp::detail::fp8_kernels {

enum class Element : uint8_t { kFloat, kBFloat16, kHalf };
enum class Format : uint8_t { kE4M3, kE5M2 };

// What the scale is derived from and where it and the amax go (on the device).
struct Scaling {
  unsigned int* amax_bits;  // scratch: the amax kernel's result
  const float* delayed_scale;
  const float* updated;
  float* current;  // delayed scaling only
  float* inverse;
  float factor, smallest_amax, fp8_max;
  bool delayed;
};

struct QuantizeJob {
  const void* x;  // rows x cols values of `element`, contiguous
  int64_t rows, cols;
  Element element;
  Format format;
  Scaling scaling;
  uint8_t* out;    // rows x cols
  uint8_t* out_t;  // cols x rows, or null: no transpose
};

// The amax pass, then the scale-and-cast pass (writing the transpose where
// job.out_t is set), on `stream`; `sms` the device's multiprocessors.
// Returns the first error (cudaSuccess: none).
cudaError_t launch_quantize(const QuantizeJob& job, int sms, cudaStream_t stream);
// in [rows, cols] (float8 bytes) transposed into out_t [cols, rows].
cudaError_t launch_transpose(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out_t, cudaStream_t stream);

// The transpose kernel, whose image for a device says whether the kernels
// run there.
const void* transpose_kernel();

}  // namespace amp::detail::fp8_kernels
