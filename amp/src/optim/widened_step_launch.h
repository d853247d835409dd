// SPDX-License-Identifier: BSD-3-Clause
// Private: the widened step's CUDA kernels (widened_step_kernels.h) as their
// .cu files see them - plain descriptions of each tensor's work and the
// launches over them, without LibTorch's headers, which take nvcc many
// times longer to compile than the kernels. widened_step_kernels.cpp
// describes tensors and checks what comes back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace amp::detail::widened_step {

// Each job's `blocks` are the thread blocks its work takes; `first_block`
// is set by the launch.
struct RoundingJob {
  const uint32_t* src;  // float32 bits
  uint16_t* dst;        // bfloat16 bits
  int64_t numel;
  uint64_t seed;
  int64_t stride;  // the threads of at::randint's grid for numel values (aten_draws.cuh)
  int64_t blocks;
  int64_t first_block;
};

struct PackingJob {
  const float* values;
  uint8_t* packed;
  const float* table;  // the code values, ascending
  int64_t numel;
  int64_t stride;  // the threads of at::rand's grid for the [rows, 256] noise
  int64_t blocks;  // one a row
  int64_t first_block;
  uint64_t seed;
  int last;  // the table's last index
  int zero;  // the code of 0
  int steps;  // codes per doubling
  bool stochastic;
};

struct UnpackingJob {
  const uint8_t* packed;
  float* values;
  const float* table;
  int64_t numel;
  int64_t blocks;  // one a row
  int64_t first_block;
  int last;
};

// Threads a block, as ATen's distribution kernels launch them.
inline constexpr int kThreads = 256;

// Launch `jobs` on `stream`, as many a launch as the kernel's argument
// holds. Returns the first launch error (cudaSuccess: none).
cudaError_t launch(const std::vector<RoundingJob>& jobs, cudaStream_t stream);
cudaError_t launch(const std::vector<PackingJob>& jobs, cudaStream_t stream);
cudaError_t launch(const std::vector<UnpackingJob>& jobs, cudaStream_t stream);

// The rounding kernel, whose image for a device says whether the kernels
// run there.
const void* rounding_kernel();

}  // namespace amp::detail::widened_step
