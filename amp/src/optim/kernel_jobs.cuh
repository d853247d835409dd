// SPDX-License-Identifier: BSD-3-Clause
// Private, CUDA only: many tensors' work in one launch of one of amp's
// kernels (widened_step_kernels.h). The tensors' descriptions (jobs) travel
// as the kernel's argument - no copy to the device, and a CUDA graph keeps
// them with the launch - up to the 32 KB an argument may take (CUDA 12.1
// and later, on Volta and later devices: CMakeLists.txt builds these
// kernels for those). Each job owns a run of the launch's blocks.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <limits>

namespace amp::detail {

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

// Collects jobs and launches `launch(jobs, blocks)` whenever a launch is full, and at flush().
template <class Job, class Launch>
class JobBatch {
 public:
  explicit JobBatch(Launch launch) : launch_(launch) {}
  // `job` (its first_block set here) and the `blocks` it takes.
  void add(Job job, int64_t blocks) {
    if (blocks == 0) return;
    if (jobs_.count == KernelJobs<Job>::kCapacity) flush();
    job.first_block = blocks_;
    jobs_.job[jobs_.count++] = job;
    blocks_ += blocks;
    TORCH_CHECK(blocks_ <= std::numeric_limits<int32_t>::max(), "amp: too much work for one kernel launch");
  }
  void flush() {
    if (jobs_.count > 0) launch_(jobs_, blocks_);
    jobs_.count = 0;
    blocks_ = 0;
  }

 private:
  Launch launch_;
  KernelJobs<Job> jobs_{};
  int64_t blocks_ = 0;
};

}  // namespace amp::detail
