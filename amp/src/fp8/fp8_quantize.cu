// The fused float8 quantization (fp8_quantize.h): two kernels on the
// current stream, and a memset.
#include "fp8/fp8_quantize.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
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

template <typename T, typename F8>
void launch(const at::Tensor& x, const Scaling& scaling, at::Tensor& out) {
  const int64_t n = x.numel();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(sms) * 8));
  const T* in = reinterpret_cast<const T*>(x.const_data_ptr());
  C10_CUDA_CHECK(cudaMemsetAsync(scaling.amax_bits, 0, sizeof(unsigned int), stream));
  amax_kernel<T><<<blocks, kThreads, 0, stream>>>(in, n, scaling.amax_bits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  scale_cast_kernel<T, F8><<<blocks, kThreads, 0, stream>>>(in, n, scaling, reinterpret_cast<F8*>(out.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_format(const at::Tensor& x, const Scaling& scaling, at::Tensor& out) {
  if (out.scalar_type() == at::kFloat8_e4m3fn) {
    launch<T, c10::Float8_e4m3fn>(x, scaling, out);
  } else {
    launch<T, c10::Float8_e5m2>(x, scaling, out);
  }
}

}  // namespace

bool fused_fp8_quantize_applies(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  return x.is_cuda() && x.is_contiguous() && x.numel() > 0 &&
         (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
}

std::pair<at::Tensor, at::Tensor> fused_fp8_quantize(const at::Tensor& x, const Fp8QuantizeState& state) {
  TORCH_INTERNAL_ASSERT(fused_fp8_quantize_applies(x), "amp: the fused float8 quantization got an unfit tensor");
  const c10::cuda::CUDAGuard device(x.device());  // the stream and the properties are x's device's
  const auto floats = x.options().dtype(at::kFloat);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(state.format));
  // [0]: the inverse scale; [1]: the amax's bits.
  at::Tensor scratch = at::empty({2}, floats);
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
      launch_format<float>(x, scaling, out);
      break;
    case at::kBFloat16:
      launch_format<c10::BFloat16>(x, scaling, out);
      break;
    default:
      launch_format<c10::Half>(x, scaling, out);
      break;
  }
  return {out, scratch.narrow(0, 0, 1).reshape({})};
}

}  // namespace amp::detail
