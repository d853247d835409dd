// SPDX-License-Identifier: BSD-3-Clause
#include "optim/widened_step_launch.h"

#include "optim/aten_draws.cuh"
#include "optim/kernel_jobs.cuh"
#include "optim/stochastic_bfloat16.cuh"

#include <cstdint>

namespace amp::detail::widened_step {
namespace {

using aten_draws::kLanes;

// One thread per (pass, thread of ATen's grid) of a job: the four values
// that thread draws with one counter in that pass, as at::randint(0, 2^16)
// draws them.
__global__ void __launch_bounds__(kThreads) round_kernel(const KernelJobs<RoundingJob> jobs) {
  const RoundingJob& job = job_of_block(jobs);
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
    job.dst[i] = stochastic_bfloat16(__uint_as_float(job.src[i]), lanes[lane] % 65536u);
  }
}

}  // namespace

cudaError_t launch(const std::vector<RoundingJob>& jobs, cudaStream_t stream) {
  return launch_batches(round_kernel, jobs, kThreads, stream);
}

const void* rounding_kernel() { return reinterpret_cast<const void*>(&round_kernel); }

}  // namespace amp::detail::widened_step
