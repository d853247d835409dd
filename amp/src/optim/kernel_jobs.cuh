// SPDX-License-Identifier: BSD-3-Clause
// Private, CUDA only: many tensors' work in one launch of one of amp's
// kernels (widened_step_launch.h). The tensors' descriptions (jobs) travel
// as the kernel's argument - no copy to the device, and a CUDA graph keeps
// them with the launch - up to the 32 KB an argument may take (CUDA 12.1
// and later, on Volta and later devices: CMakeLists.txt builds these
// kernels for those). Each job owns a run of the launch's blocks.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

namespace amp::detail::widened_step {

// A launch's jobs, in the order of their blocks; Job has `first_block`.
template <class Job>
struct KernelJobs {
  static constexpr int kCapacity = static_cast<int>((32000 - sizeof(int)) / sizeof(Job));
  Job job[kCapacity];
  int count;
};

// The job that this thread block works for: the last whose first block is
// at or before it.
template <class Job>
__device__ inline const Job& job_of_block(const KernelJobs<Job>& jobs) {
  const int64_t block = blockIdx.x;
  int lo = 0, hi = jobs.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (jobs.job[mid].first_block <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return jobs.job[lo];
}

// Launches `kernel` over `jobs`, `threads` a block, with `shared` (what
// every job shares, a few bytes beside the jobs' 32000) after them: a launch
// whenever one is full (of jobs, or of blocks for a grid). The first launch
// error.
template <class Job, class... Shared>
cudaError_t launch_batches(void (*kernel)(KernelJobs<Job>, Shared...), const std::vector<Job>& jobs, int threads,
                           cudaStream_t stream, Shared... shared) {
  auto batch = std::make_unique<KernelJobs<Job>>();  // 32 KB: off the stack
  batch->count = 0;
  int64_t blocks = 0;
  auto flush = [&]() -> cudaError_t {
    if (batch->count == 0) return cudaSuccess;
    kernel<<<static_cast<unsigned int>(blocks), threads, 0, stream>>>(*batch, shared...);
    batch->count = 0;
    blocks = 0;
    return cudaGetLastError();
  };
  for (Job job : jobs) {
    if (job.blocks == 0) continue;
    if (batch->count == KernelJobs<Job>::kCapacity || blocks + job.blocks > std::numeric_limits<int32_t>::max()) {
      if (const cudaError_t error = flush(); error != cudaSuccess) return error;
    }
    job.first_block = blocks;
    batch->job[batch->count++] = job;
    blocks += job.blocks;
  }
  return flush();
}

}  // namespace amp::detail::widened_step
