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

// A packed 8-bit state's code (eight_bit_state.h).
struct CodeBook {
  const float* table;  // the code values, ascending
  int last;            // the table's last index
  int zero;            // the code of 0
  int steps;           // codes per doubling
};

// The draws a rounding or coding takes: value i's is the one at::randint
// (bfloat16 rounding) or at::rand (8-bit coding, over the [rows, 256] padded
// values) gives value i of a tensor of that many values (aten_draws.cuh).
struct StateNoise {
  uint64_t seed;
  int64_t stride;   // the threads of ATen's grid for that many values
  bool stochastic;  // 8-bit coding: false codes to nearest, drawing nothing
};

struct PackingJob {
  const float* values;
  uint8_t* packed;
  CodeBook book;
  StateNoise noise;
  int64_t numel;
  int64_t blocks;  // one a row
  int64_t first_block;
};

struct UnpackingJob {
  const uint8_t* packed;
  float* values;
  CodeBook book;
  int64_t numel;
  int64_t blocks;  // one a row
  int64_t first_block;
};

// How a fused step keeps one of its columns.
enum class Kept : uint8_t { kFloat32, kBFloat16, kPacked };

// One column of a slice a fused step reads and writes in place: float32,
// bfloat16 (written rounded stochastically with `noise`), or packed 8-bit
// state (written coded with `noise` and `book`).
struct ColumnJob {
  void* data;  // null: the column is empty
  Kept kept;
  CodeBook book;
  StateNoise noise;
};

// One slice of Adam's or AdamW's step, one block a row of 256 values: the
// parameter, its gradient (read only) and its state.
struct AdamJob {
  ColumnJob param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq;
  const float* step;  // the parameter's step count on the device, this step's included
  int64_t numel;
  int64_t blocks;
  int64_t first_block;
};

// What every slice of one Adam step shares: the group's options as ATen's
// fused kernels take them (float32), and the overflow flag (null: none).
struct AdamStep {
  float lr, beta1, beta2, weight_decay, eps;
  const float* found_inf;  // 1: the step is skipped
  bool adamw;
  bool amsgrad;
};

// One slice of SGD's step, as AdamJob's: the parameter, its gradient (read
// only) and its momentum buffer (empty without momentum).
struct SgdJob {
  ColumnJob param, grad, momentum_buffer;
  int64_t numel;
  int64_t blocks;
  int64_t first_block;
};

// What every slice of one SGD step shares, as AdamStep's.
struct SgdStep {
  float lr, weight_decay, momentum, dampening;
  const float* found_inf;  // 1: the step is skipped
  bool nesterov;
  bool first_step;  // the momentum buffer is the gradient
};

// Threads a block, as ATen's distribution kernels launch them.
inline constexpr int kThreads = 256;

// Launch `jobs` on `stream`, as many a launch as the kernel's argument
// holds. Returns the first launch error (cudaSuccess: none).
cudaError_t launch(const std::vector<RoundingJob>& jobs, cudaStream_t stream);
cudaError_t launch(const std::vector<PackingJob>& jobs, cudaStream_t stream);
cudaError_t launch(const std::vector<UnpackingJob>& jobs, cudaStream_t stream);
cudaError_t launch(const std::vector<AdamJob>& jobs, const AdamStep& step, cudaStream_t stream);
cudaError_t launch(const std::vector<SgdJob>& jobs, const SgdStep& step, cudaStream_t stream);

// The rounding kernel, whose image for a device says whether the kernels
// run there.
const void* rounding_kernel();

}  // namespace amp::detail::widened_step
