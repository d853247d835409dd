// SPDX-License-Identifier: BSD-3-Clause
// The fused float8 quantization (fp8_quantize.h): two kernels on the
// current stream, and a memset; the second writes a matrix's transpose too
// where asked. And a float8 matrix's transpose.
#include "fp8/fp8_quantize.h"

#include "support/kernel_image.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cstdint>

namespace amp::detail {
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

struct Scaling {
  unsigned int* amax_bits;  // the amax kernel's result
  const float* delayed_scale;
  const float* updated;
  float* current;
  float* inverse;
  float factor, smallest_amax, fp8_max;
  bool delayed;
};

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
void launch(const at::Tensor& x, const Scaling& scaling, at::Tensor& out, at::Tensor* out_t) {
  const int64_t n = x.numel();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(sms) * 8));
  const T* in = reinterpret_cast<const T*>(x.const_data_ptr());
  C10_CUDA_CHECK(cudaMemsetAsync(scaling.amax_bits, 0, sizeof(unsigned int), stream));
  amax_kernel<T><<<blocks, kThreads, 0, stream>>>(in, n, scaling.amax_bits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (out_t == nullptr) {
    scale_cast_kernel<T, F8><<<blocks, kThreads, 0, stream>>>(in, n, scaling, reinterpret_cast<F8*>(out.data_ptr()));
  } else {
    const int64_t rows = x.size(0), cols = x.size(1);
    scale_cast_transpose_kernel<T, F8><<<tiles(rows, cols), dim3(kTile, kTileRows), 0, stream>>>(
        in, rows, cols, scaling, static_cast<uint8_t*>(out.data_ptr()), static_cast<uint8_t*>(out_t->data_ptr()));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_format(const at::Tensor& x, const Scaling& scaling, at::Tensor& out, at::Tensor* out_t) {
  if (out.scalar_type() == at::kFloat8_e4m3fn) {
    launch<T, c10::Float8_e4m3fn>(x, scaling, out, out_t);
  } else {
    launch<T, c10::Float8_e5m2>(x, scaling, out, out_t);
  }
}

// The quantization of x into `out` (and its transpose into *out_t, if
// given): the inverse scale.
at::Tensor quantize_into(const at::Tensor& x, const Fp8QuantizeState& state, at::Tensor& out, at::Tensor* out_t) {
  TORCH_INTERNAL_ASSERT(fused_fp8_quantize_applies(x), "amp: the fused float8 quantization got an unfit tensor");
  const c10::cuda::CUDAGuard device(x.device());  // the stream and the properties are x's device's
  // [0]: the inverse scale; [1]: the amax's bits.
  at::Tensor scratch = at::empty({2}, x.options().dtype(at::kFloat));
  Scaling scaling{reinterpret_cast<unsigned int*>(scratch.data_ptr<float>() + 1),
                  state.scale.data_ptr<float>(),
                  state.updated.data_ptr<float>(),
                  state.delayed ? state.current.data_ptr<float>() : nullptr,
                  scratch.data_ptr<float>(),
                  static_cast<float>(state.factor),
                  state.smallest_amax,
                  static_cast<float>(state.fp8_max),
                  state.delayed};
  switch (x.scalar_type()) {
    case at::kFloat:
      launch_format<float>(x, scaling, out, out_t);
      break;
    case at::kBFloat16:
      launch_format<c10::BFloat16>(x, scaling, out, out_t);
      break;
    default:
      launch_format<c10::Half>(x, scaling, out, out_t);
      break;
  }
  return scratch.narrow(0, 0, 1).reshape({});
}

}  // namespace

bool fp8_kernels_run_on(c10::DeviceIndex index) {
  static std::array<std::atomic<uint8_t>, 64> answers{};
  return has_image_for(transpose_bytes_kernel, index, answers);
}

bool fused_fp8_quantize_applies(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  return x.is_cuda() && x.is_contiguous() && x.numel() > 0 &&
         (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) && fp8_kernels_run_on(x.device().index());
}

std::pair<at::Tensor, at::Tensor> fused_fp8_quantize(const at::Tensor& x, const Fp8QuantizeState& state) {
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(state.format));
  at::Tensor inverse = quantize_into(x, state, out, nullptr);
  return {out, inverse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_fp8_quantize_transposed(const at::Tensor& x,
                                                                            const Fp8QuantizeState& state) {
  TORCH_INTERNAL_ASSERT(x.dim() == 2, "amp: the float8 cast-transpose takes a matrix");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(state.format));
  at::Tensor out_t = at::empty({x.size(1), x.size(0)}, out.options());
  at::Tensor inverse = quantize_into(x, state, out, &out_t);
  return {out, inverse, out_t};
}

bool fused_fp8_transpose_applies(const at::Tensor& m) {
  return m.is_cuda() && m.dim() == 2 && m.is_contiguous() && m.numel() > 0 &&
         (m.scalar_type() == at::kFloat8_e4m3fn || m.scalar_type() == at::kFloat8_e5m2) &&
         fp8_kernels_run_on(m.device().index());
}

at::Tensor fused_fp8_transpose(const at::Tensor& m) {
  TORCH_INTERNAL_ASSERT(fused_fp8_transpose_applies(m), "amp: the float8 transpose got an unfit tensor");
  const c10::cuda::CUDAGuard device(m.device());
  const int64_t rows = m.size(0), cols = m.size(1);
  at::Tensor out_t = at::empty({cols, rows}, m.options());
  transpose_bytes_kernel<<<tiles(rows, cols), dim3(kTile, kTileRows), 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint8_t*>(m.const_data_ptr()), rows, cols, static_cast<uint8_t*>(out_t.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out_t;
}

}  // namespace amp::detail
