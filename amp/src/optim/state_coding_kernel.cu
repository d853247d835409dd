// SPDX-License-Identifier: BSD-3-Clause
#include "optim/widened_step_launch.h"

#include "optim/kernel_jobs.cuh"
#include "optim/state_coding.cuh"

#include <cstdint>

namespace amp::detail::widened_step {
namespace {

using coding::kBlock;
using coding::kRow;

// One block a packed row, one thread a value: code_blocks
// (eight_bit_state.cpp) as the ATen ops compute it.
__global__ void __launch_bounds__(kBlock) pack_kernel(const KernelJobs<PackingJob> jobs) {
  __shared__ float scratch[kBlock / 32];
  const PackingJob& job = job_of_block(jobs);
  const int64_t row = static_cast<int64_t>(blockIdx.x) - job.first_block;
  const int64_t i = row * kBlock + threadIdx.x;
  const float x = i < job.numel ? job.values[i] : 0.0f;  // the last row padded with zeros
  coding::pack_value(job.book, job.noise, x, i, job.packed + row * kRow, scratch);
}

// One block a packed row, one thread a value: unpack_by_aten_ops' values.
__global__ void __launch_bounds__(kBlock) unpack_kernel(const KernelJobs<UnpackingJob> jobs) {
  const UnpackingJob& job = job_of_block(jobs);
  const int64_t row = static_cast<int64_t>(blockIdx.x) - job.first_block;
  const int64_t i = row * kBlock + threadIdx.x;
  if (i >= job.numel) return;
  job.values[i] = coding::unpack_value(job.book, job.packed + row * kRow);
}

}  // namespace

cudaError_t launch(const std::vector<PackingJob>& jobs, cudaStream_t stream) {
  return launch_batches(pack_kernel, jobs, kBlock, stream);
}

cudaError_t launch(const std::vector<UnpackingJob>& jobs, cudaStream_t stream) {
  return launch_batches(unpack_kernel, jobs, kBlock, stream);
}

}  // namespace amp::detail::widened_step
