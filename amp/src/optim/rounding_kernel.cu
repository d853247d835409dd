// SPDX-License-Identifier: BSD-3-Clause
#include "optim/widened_step_kernels.h"

#include "optim/aten_draws.cuh"
#include "optim/kernel_jobs.cuh"
#include "support/kernel_image.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>

namespace amp::detail {
namespace {

using aten_draws::kLanes;
using aten_draws::kThreads;
struct Job {
  const uint32_t* src;
  uint16_t* dst;
  int64_t numel;
  uint64_t seed;
  int64_t stride;       // the threads of ATen's grid for this numel: values drawn by one counter lie this far apart
  int64_t first_block;  // this launch's first block for the job
};

// One thread per (pass, thread of ATen's grid) of a job: the four values
// that thread draws with one counter in that pass, as at::randint(0, 2^16)
// draws them, added below bfloat16's cut and truncated; NaN stays NaN.
__global__ void __launch_bounds__(kThreads) round_kernel(const KernelJobs<Job> jobs) {
  const Job& job = job_of_block(jobs);
  const int64_t item = (static_cast<int64_t>(blockIdx.x) - job.first_block) * kThreads + threadIdx.x;
  const int64_t thread = item % job.stride, pass = item / job.stride;
  const int64_t first = pass * kLanes * job.stride + thread;
  if (first >= job.numel) return;
  curandStatePhilox4_32_10_t state = aten_draws::state_at(job.seed, thread, pass);
  const uint4 draw = curand4(&state);
  const uint32_t lanes[kLanes] = {draw.x, draw.y, draw.z, draw.w};
#pragma unroll
  for (int lane = 0; lane < kLanes; ++lane) {
    const int64_t i = first + lane * job.stride;
    if (i >= job.numel) break;
    const uint32_t bits = job.src[i];
    const float x = __uint_as_float(bits);
    const float rounded = x != x ? __int_as_float(0x7FC00000)  // masked_fill's quiet NaN
                                 : __uint_as_float((bits + (lanes[lane] % 65536u)) & 0xFFFF0000u);
    job.dst[i] = c10::BFloat16(rounded).x;
  }
}

void launch(const KernelJobs<Job>& jobs, int64_t blocks) {
  round_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(jobs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool widened_step_kernels_apply(const at::Tensor& t) {
  static std::array<std::atomic<uint8_t>, 64> answers{};
  return t.is_cuda() && has_image_for(round_kernel, t.device().index(), answers);
}

void round_on_cuda(const std::vector<CudaRounding>& roundings) {
  if (roundings.empty()) return;
  const c10::cuda::CUDAGuard device(roundings.front().src.device());  // ATen's grid is this device's
  JobBatch<Job, decltype(&launch)> batch(&launch);
  for (const CudaRounding& r : roundings) {
    TORCH_INTERNAL_ASSERT(r.src.scalar_type() == at::kFloat && r.dst.scalar_type() == at::kBFloat16 &&
                          r.src.numel() == r.dst.numel() && r.src.is_contiguous() && r.dst.is_contiguous() &&
                          r.src.device() == roundings.front().src.device() && r.dst.device() == r.src.device(),
                          "amp: the CUDA rounding kernel got an unfit tensor");
    const int64_t numel = r.src.numel();
    if (numel == 0) continue;
    const int64_t stride = aten_draws::grid_threads(numel);
    const int64_t passes = (numel + kLanes * stride - 1) / (kLanes * stride);
    batch.add({reinterpret_cast<const uint32_t*>(r.src.const_data_ptr<float>()),
               reinterpret_cast<uint16_t*>(r.dst.mutable_data_ptr<at::BFloat16>()), numel, r.seed, stride, 0},
              passes * stride / kThreads);
  }
  batch.flush();
}

}  // namespace amp::detail
