// SPDX-License-Identifier: BSD-3-Clause
#include "optim/widened_step_kernels.h"

#ifdef AMP_WITH_CUDA_KERNELS

#include "optim/widened_step_launch.h"
#include "support/kernel_image.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>

namespace amp::detail {
namespace {

constexpr int64_t kLanes = 4;
constexpr int64_t kRowValues = 256, kRowBytes = kRowValues + 1;  // eight_bit_state.h's packed rows

// The threads ATen's distribution kernel launches for `numel` values on
// the current device (calc_execution_policy): blocks of 256, at most as
// many as the device keeps resident.
int64_t aten_grid_threads(int64_t numel) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t blocks_per_sm = props->maxThreadsPerMultiProcessor / widened_step::kThreads;
  const int64_t blocks = std::min<int64_t>(props->multiProcessorCount * blocks_per_sm,
                                           (numel + widened_step::kThreads - 1) / widened_step::kThreads);
  return blocks * widened_step::kThreads;
}

bool fits_packed(const at::Tensor& values, const at::Tensor& packed, const at::Tensor& table, c10::Device device) {
  const int64_t rows = (values.numel() + kRowValues - 1) / kRowValues;
  return values.scalar_type() == at::kFloat && values.is_contiguous() && packed.scalar_type() == at::kByte &&
         packed.is_contiguous() && packed.numel() == rows * kRowBytes && table.scalar_type() == at::kFloat &&
         values.device() == device && packed.device() == device && table.device() == device;
}

}  // namespace

bool widened_step_kernels_apply(const at::Tensor& t) {
  static std::array<std::atomic<uint8_t>, 64> answers{};
  return t.is_cuda() && has_image_for(widened_step::rounding_kernel(), t.device().index(), answers);
}

void round_on_cuda(const std::vector<CudaRounding>& roundings) {
  if (roundings.empty()) return;
  const c10::Device device = roundings.front().src.device();
  const c10::cuda::CUDAGuard guard(device);  // ATen's grid is this device's
  std::vector<widened_step::RoundingJob> jobs;
  for (const CudaRounding& r : roundings) {
    TORCH_INTERNAL_ASSERT(r.src.scalar_type() == at::kFloat && r.dst.scalar_type() == at::kBFloat16 &&
                          r.src.numel() == r.dst.numel() && r.src.is_contiguous() && r.dst.is_contiguous() &&
                          r.src.device() == device && r.dst.device() == device,
                          "amp: the CUDA rounding kernel got an unfit tensor");
    const int64_t numel = r.src.numel();
    if (numel == 0) continue;
    const int64_t stride = aten_grid_threads(numel);
    const int64_t passes = (numel + kLanes * stride - 1) / (kLanes * stride);
    jobs.push_back({reinterpret_cast<const uint32_t*>(r.src.const_data_ptr<float>()),
                    reinterpret_cast<uint16_t*>(r.dst.mutable_data_ptr<at::BFloat16>()), numel, r.seed, stride,
                    passes * stride / widened_step::kThreads, 0});
  }
  C10_CUDA_CHECK(widened_step::launch(jobs, at::cuda::getCurrentCUDAStream()));
}

void pack_on_cuda(const std::vector<CudaPacking>& packings) {
  if (packings.empty()) return;
  const c10::Device device = packings.front().values.device();
  const c10::cuda::CUDAGuard guard(device);  // at::rand's grid is this device's
  std::vector<widened_step::PackingJob> jobs;
  for (const CudaPacking& p : packings) {
    TORCH_INTERNAL_ASSERT(fits_packed(p.values, p.packed, p.table, device),
                          "amp: the CUDA state coding kernel got an unfit tensor");
    const int64_t rows = (p.values.numel() + kRowValues - 1) / kRowValues;
    if (rows == 0) continue;
    const int last = static_cast<int>(p.table.numel()) - 1;
    jobs.push_back({p.values.const_data_ptr<float>(), p.packed.mutable_data_ptr<uint8_t>(),
                    p.table.const_data_ptr<float>(), p.values.numel(), aten_grid_threads(rows * kRowValues), rows, 0,
                    p.seed.value_or(0), last, p.non_negative ? 0 : last / 2, p.non_negative ? 4 : 8,
                    p.seed.has_value()});
  }
  C10_CUDA_CHECK(widened_step::launch(jobs, at::cuda::getCurrentCUDAStream()));
}

void unpack_on_cuda(const std::vector<CudaUnpacking>& unpackings) {
  if (unpackings.empty()) return;
  const c10::Device device = unpackings.front().values.device();
  const c10::cuda::CUDAGuard guard(device);
  std::vector<widened_step::UnpackingJob> jobs;
  for (const CudaUnpacking& u : unpackings) {
    TORCH_INTERNAL_ASSERT(fits_packed(u.values, u.packed, u.table, device),
                          "amp: the CUDA state decoding kernel got an unfit tensor");
    const int64_t rows = (u.values.numel() + kRowValues - 1) / kRowValues;
    if (rows == 0) continue;
    jobs.push_back({u.packed.const_data_ptr<uint8_t>(), u.values.mutable_data_ptr<float>(),
                    u.table.const_data_ptr<float>(), u.values.numel(), rows, 0,
                    static_cast<int>(u.table.numel()) - 1});
  }
  C10_CUDA_CHECK(widened_step::launch(jobs, at::cuda::getCurrentCUDAStream()));
}

}  // namespace amp::detail

#endif  // AMP_WITH_CUDA_KERNELS
