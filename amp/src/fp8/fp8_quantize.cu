// SPDX-License-Identifier: BSD-3-Clause
// The fused float8 quantization's kernels (fp8_quantize_launch.h): the amax
// reduction and the pass that scales and casts (and transposes where asked),
// and a float8 matrix's transpose.
#include "fp8/fp8_quantize_launch.h"

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Float8_e4m3fn.h>
#include <torch/headeronly/util/Float8_e5m2.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

namespace amp::detail::fp8_kernels {
namespace {

constexpr int kThreads = 256;

// Non-negative floats order as their bits do, and a NaN with its sign bit
// clear above them all: one unsigned atomicMax keeps the largest |x| and
// any NaN, as ATen's infinity norm does.
__device__ float larger(float a, float b) { return (b != b || b > a) ? b : a; }

template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, unsigned int* amax_bits) {
  float m = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(blockDim.x) * gridDim.x) {
    m = larger(m, fabsf(static_cast<float>(x[i])));
  }
  for (int offset = 16; offset > 0; offset >>= 1) m = larger(m, __shfl_down_sync(0xffffffffu, m, offset));
  __shared__ float warps[kThreads / 32];
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = larger(m, warps[w]);
    atomicMax(amax_bits, __float_as_uint(m));
  }
}

// ATen's lerp (ATen/native/Lerp.h): exactly `self` at weight 0, `end` at 1.
__device__ float lerp(float self, float end, float weight) {
  return fabsf(weight) < 0.5f ? self + weight * (end - self) : end - (end - self) * (1.0f - weight);
}

// Fp8Scaler::quantize's scale, from the amax: its own where that is finite
// and at least the smallest usable, else the delayed one; with delayed
// scaling the delayed one once a history set it.
__device__ float scale_of(const Scaling& s, float amax) {
  const bool usable = fminf(fmaxf(amax, s.smallest_amax), FLT_MAX) == amax;  // NaN and inf fail
  const float fresh = (1.0f / amax) * s.factor;
  const float scale = usable ? fresh : *s.delayed_scale;
  return s.delayed ? lerp(scale, *s.delayed_scale, *s.updated) : scale;
}

template <typename T, typename F8>
__global__ void scale_cast_kernel(const T* __restrict__ x, int64_t n, Scaling s, F8* __restrict__ out) {
  const float amax = __uint_as_float(*s.amax_bits);
  const float scale = scale_of(s, amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    // + 0 * amax: NaN where x held an inf or NaN, so the GEMM's product is
    // not finite and the loss scaler sees the overflow.
    *s.inverse = 1.0f / scale + 0.0f * amax;
    if (s.delayed) *s.current = fmaxf(*s.current, isfinite(amax) ? amax : 0.0f);
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(blockDim.x) * gridDim.x) {
    float v = static_cast<float>(x[i]) * scale;
    if (!isnan(v)) v = fminf(fmaxf(v, -s.fp8_max), s.fp8_max);
    out[i] = F8(v);
  }
}

// Matrices are transposed in tiles of kTile x kTile by blocks of kTile x
// kTileRows threads: a tile is read and written a row of 32 bytes or more at
// a time, and turns in shared memory.
constexpr int kTile = 32, kTileRows = 8;

// The tile of [rows, cols] that block blockIdx.x (of a one-dimensional grid)
// covers: its first row and column.
struct Tile {
  int64_t row, col;
};
__device__ Tile tile_of(int64_t cols) {
  const int64_t across = (cols + kTile - 1) / kTile;
  return {(blockIdx.x / across) * kTile, (blockIdx.x % across) * kTile};
}

// The block's tile, held in `tile` by rows, written to the transpose out_t
// [cols, rows].
__device__ void write_transposed(const uint8_t (&tile)[kTile][kTile + 1], Tile t, int64_t rows, int64_t cols,
                                 uint8_t* __restrict__ out_t) {
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t c = t.col + i, r = t.row + threadIdx.x;
    if (r < rows && c < cols) out_t[c * rows + r] = tile[threadIdx.x][i];
  }
}

// scale_cast_kernel's values of x [rows, cols], written both ways.
template <typename T, typename F8>
__global__ void scale_cast_transpose_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, Scaling s,
                                            uint8_t* __restrict__ out, uint8_t* __restrict__ out_t) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const float amax = __uint_as_float(*s.amax_bits);
  const float scale = scale_of(s, amax);
  if (blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    *s.inverse = 1.0f / scale + 0.0f * amax;  // as scale_cast_kernel
    if (s.delayed) *s.current = fmaxf(*s.current, isfinite(amax) ? amax : 0.0f);
  }
  const Tile t = tile_of(cols);
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t r = t.row + i, c = t.col + threadIdx.x;
    if (r < rows && c < cols) {
      float v = static_cast<float>(x[r * cols + c]) * scale;
      if (!isnan(v)) v = fminf(fmaxf(v, -s.fp8_max), s.fp8_max);
      const uint8_t bits = F8(v).x;
      out[r * cols + c] = bits;
      tile[i][threadIdx.x] = bits;
    }
  }
  __syncthreads();
  write_transposed(tile, t, rows, cols, out_t);
}

__global__ void transpose_bytes_kernel(const uint8_t* __restrict__ in, int64_t rows, int64_t cols,
                                       uint8_t* __restrict__ out_t) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const Tile t = tile_of(cols);
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t r = t.row + i, c = t.col + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  write_transposed(tile, t, rows, cols, out_t);
}

int64_t tiles(int64_t rows, int64_t cols) { return ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile); }

template <typename T, typename F8>
cudaError_t launch(const QuantizeJob& job, int sms, cudaStream_t stream) {
  const int64_t n = job.rows * job.cols;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(sms) * 8));
  const T* in = static_cast<const T*>(job.x);
  if (const cudaError_t e = cudaMemsetAsync(job.scaling.amax_bits, 0, sizeof(unsigned int), stream)) return e;
  amax_kernel<T><<<blocks, kThreads, 0, stream>>>(in, n, job.scaling.amax_bits);
  if (const cudaError_t e = cudaGetLastError()) return e;
  if (job.out_t == nullptr) {
    scale_cast_kernel<T, F8><<<blocks, kThreads, 0, stream>>>(in, n, job.scaling, reinterpret_cast<F8*>(job.out));
  } else {
    scale_cast_transpose_kernel<T, F8><<<tiles(job.rows, job.cols), dim3(kTile, kTileRows), 0, stream>>>(
        in, job.rows, job.cols, job.scaling, job.out, job.out_t);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_format(const QuantizeJob& job, int sms, cudaStream_t stream) {
  return job.format == Format::kE4M3 ? launch<T, c10::Float8_e4m3fn>(job, sms, stream)
                                     : launch<T, c10::Float8_e5m2>(job, sms, stream);
}

}  // namespace

cudaError_t launch_quantize(const QuantizeJob& job, int sms, cudaStream_t stream) {
  switch (job.element) {
    case Element::kFloat:
      return launch_format<float>(job, sms, stream);
    case Element::kBFloat16:
      return launch_format<c10::BFloat16>(job, sms, stream);
    case Element::kHalf:
      break;
  }
  return launch_format<c10::Half>(job, sms, stream);
}

cudaError_t launch_transpose(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out_t, cudaStream_t stream) {
  transpose_bytes_kernel<<<tiles(rows, cols), dim3(kTile, kTileRows), 0, stream>>>(in, rows, cols, out_t);
  return cudaGetLastError();
}

const void* transpose_kernel() { return reinterpret_cast<const void*>(&transpose_bytes_kernel); }

}  // namespace amp::detail::fp8_kernels
