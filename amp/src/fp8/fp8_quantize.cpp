// SPDX-License-Identifier: BSD-3-Clause
// The fused float8 quantization (fp8_quantize.h): the tensors described to
// fp8_quantize.cu's kernels, on the current stream.
#include "fp8/fp8_quantize.h"

#ifdef AMP_WITH_FP8_KERNELS

#include "fp8/fp8_quantize_launch.h"
#include "support/kernel_image.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <atomic>

namespace amp::detail {
namespace {

fp8_kernels::Element element_of(at::ScalarType t) {
  if (t == at::kFloat) return fp8_kernels::Element::kFloat;
  return t == at::kBFloat16 ? fp8_kernels::Element::kBFloat16 : fp8_kernels::Element::kHalf;
}

// The quantization of x into `out` (and its transpose into *out_t, if
// given): the inverse scale.
at::Tensor quantize_into(const at::Tensor& x, const Fp8QuantizeState& state, at::Tensor& out, at::Tensor* out_t) {
  TORCH_INTERNAL_ASSERT(fused_fp8_quantize_applies(x), "amp: the fused float8 quantization got an unfit tensor");
  const c10::cuda::CUDAGuard device(x.device());  // the stream and the properties are x's device's
  // [0]: the inverse scale; [1]: the amax's bits.
  at::Tensor scratch = at::empty({2}, x.options().dtype(at::kFloat));
  const bool transposed = out_t != nullptr;
  const fp8_kernels::QuantizeJob job{
      x.const_data_ptr(),
      transposed ? x.size(0) : 1,
      transposed ? x.size(1) : x.numel(),
      element_of(x.scalar_type()),
      out.scalar_type() == at::kFloat8_e4m3fn ? fp8_kernels::Format::kE4M3 : fp8_kernels::Format::kE5M2,
      {reinterpret_cast<unsigned int*>(scratch.data_ptr<float>() + 1), state.scale.data_ptr<float>(),
       state.updated.data_ptr<float>(), state.delayed ? state.current.data_ptr<float>() : nullptr,
       scratch.data_ptr<float>(), static_cast<float>(state.factor), state.smallest_amax,
       static_cast<float>(state.fp8_max), state.delayed},
      static_cast<uint8_t*>(out.data_ptr()),
      transposed ? static_cast<uint8_t*>(out_t->data_ptr()) : nullptr};
  C10_CUDA_CHECK(fp8_kernels::launch_quantize(job, at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                                              at::cuda::getCurrentCUDAStream()));
  return scratch.narrow(0, 0, 1).reshape({});
}

}  // namespace

bool fp8_kernels_run_on(c10::DeviceIndex index) {
  static std::array<std::atomic<uint8_t>, 64> answers{};
  return has_image_for(fp8_kernels::transpose_kernel(), index, answers);
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
  C10_CUDA_CHECK(fp8_kernels::launch_transpose(static_cast<const uint8_t*>(m.const_data_ptr()), rows, cols,
                                               static_cast<uint8_t*>(out_t.data_ptr()),
                                               at::cuda::getCurrentCUDAStream()));
  return out_t;
}

}  // namespace amp::detail

#endif  // AMP_WITH_FP8_KERNELS
