// SPDX-License-Identifier: BSD-3-Clause
#include "optim/widened_step_launch.h"

#include "optim/aten_draws.cuh"
#include "optim/kernel_jobs.cuh"
#include "optim/state_coding.cuh"
#include "optim/stochastic_bfloat16.cuh"

#include <cstdint>

namespace amp::detail::widened_step {
namespace {

using coding::kBlock;
using coding::kRow;

// This thread's value of its block's slice: value `i`, in packed row `row`;
// `mine` false past the slice's values (the last row's padding).
struct Place {
  int64_t row, i;
  bool mine;
};

template <class Job>
__device__ Place place_in(const Job& job) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) - job.first_block;
  const int64_t i = row * kBlock + threadIdx.x;
  return {row, i, i < job.numel};
}

// Value `at` of `column` in float32 (0 past the slice's values).
__device__ float read(const ColumnJob& column, const Place& at) {
  const int64_t row = at.row, i = at.i;
  if (!at.mine || column.data == nullptr) return 0.0f;
  switch (column.kept) {
    case Kept::kFloat32: return static_cast<const float*>(column.data)[i];
    case Kept::kBFloat16: return __uint_as_float(uint32_t{static_cast<const uint16_t*>(column.data)[i]} << 16);
    case Kept::kPacked: return coding::unpack_value(column.book, static_cast<const uint8_t*>(column.data) + row * kRow);
  }
  return 0.0f;
}

// Writes `x` as value `at` of `column`: rounded or coded as the chunked
// path's kernels write it back. Every thread of the block calls it (a
// packed row is coded by all of them).
__device__ void write(const ColumnJob& column, const Place& at, float x, float* scratch) {
  const int64_t row = at.row, i = at.i;
  const bool mine = at.mine;
  switch (column.kept) {
    case Kept::kFloat32:
      if (mine) static_cast<float*>(column.data)[i] = x;
      return;
    case Kept::kBFloat16:
      if (mine) {
        const uint32_t noise = aten_draws::randint16(column.noise.seed, i, column.noise.stride);
        static_cast<uint16_t*>(column.data)[i] = stochastic_bfloat16(x, noise);
      }
      return;
    case Kept::kPacked:
      coding::pack_value(column.book, column.noise, mine ? x : 0.0f, i,
                         static_cast<uint8_t*>(column.data) + row * kRow, scratch);
      return;
  }
}

// ATen's CUDA Adam arithmetic for one value (adam_math in
// ATen/native/cuda/fused_adam_utils.cuh, ATen 2.11: the same float32
// operations in the same order, contracted alike, so the same bits).
__device__ void adam_update(const AdamStep& h, float step, float& param, float grad, float& exp_avg,
                            float& exp_avg_sq, float& max_exp_avg_sq) {
  const float bias_correction1 = 1 - ::pow(h.beta1, step);
  const float bias_correction2 = 1 - ::pow(h.beta2, step);
  const float bias_correction2_sqrt = ::sqrt(bias_correction2);
  if (h.weight_decay != 0) {
    if (h.adamw) {
      param -= h.lr * h.weight_decay * param;
    } else {
      grad += param * h.weight_decay;
    }
  }
  exp_avg = ::fma(h.beta1, exp_avg, ::fma(-h.beta1, grad, grad));
  exp_avg_sq = ::fma(h.beta2, exp_avg_sq, ::fma(-h.beta2, grad * grad, grad * grad));
  const float step_size = h.lr / bias_correction1;
  float denom;
  if (h.amsgrad) {
    max_exp_avg_sq = max_exp_avg_sq < exp_avg_sq ? exp_avg_sq : max_exp_avg_sq;  // std::max's NaN
    denom = (::sqrt(max_exp_avg_sq) / bias_correction2_sqrt) + h.eps;
  } else {
    denom = (::sqrt(exp_avg_sq) / bias_correction2_sqrt) + h.eps;
  }
  param -= step_size * exp_avg / denom;
}

// ATen's CUDA SGD arithmetic for one value (sgd_math in FusedSgdKernel.cu,
// ATen 2.11: the options as float32, as its functor passes them).
__device__ void sgd_update(const SgdStep& h, bool has_buffer, float& param, float grad, float& buffer) {
  if (h.weight_decay != 0) grad += h.weight_decay * param;
  if (has_buffer) {
    buffer = h.first_step ? grad : (h.momentum * buffer + (1 - h.dampening) * grad);
    if (h.nesterov) {
      grad = grad + h.momentum * buffer;
    } else {
      grad = buffer;
    }
  }
  param -= h.lr * grad;
}

__device__ bool skipped(const float* found_inf) { return found_inf != nullptr && *found_inf == 1; }

// One slice's row of 256 values a block, one value a thread: decoded from
// its columns, stepped as ATen's fused kernel steps it, and written back -
// what the chunked path does in five launches and three float32 copies of
// the slice. A skipped step writes back what it read, as the chunked path's
// kernels do after ATen's kernel changed nothing.
__global__ void __launch_bounds__(kBlock) adam_kernel(const KernelJobs<AdamJob> jobs, const AdamStep h) {
  __shared__ float scratch[kBlock / 32];
  const AdamJob& job = job_of_block(jobs);
  const Place at = place_in(job);
  float param = read(job.param, at), grad = read(job.grad, at);
  float exp_avg = read(job.exp_avg, at), exp_avg_sq = read(job.exp_avg_sq, at);
  float max_exp_avg_sq = h.amsgrad ? read(job.max_exp_avg_sq, at) : 0.0f;
  if (at.mine && !skipped(h.found_inf)) adam_update(h, *job.step, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq);
  write(job.param, at, param, scratch);
  write(job.exp_avg, at, exp_avg, scratch);
  write(job.exp_avg_sq, at, exp_avg_sq, scratch);
  if (h.amsgrad) write(job.max_exp_avg_sq, at, max_exp_avg_sq, scratch);
}

// SGD's, as adam_kernel's.
__global__ void __launch_bounds__(kBlock) sgd_kernel(const KernelJobs<SgdJob> jobs, const SgdStep h) {
  __shared__ float scratch[kBlock / 32];
  const SgdJob& job = job_of_block(jobs);
  const Place at = place_in(job);
  const bool has_buffer = job.momentum_buffer.data != nullptr;
  float param = read(job.param, at), grad = read(job.grad, at);
  float buffer = has_buffer ? read(job.momentum_buffer, at) : 0.0f;
  if (at.mine && !skipped(h.found_inf)) sgd_update(h, has_buffer, param, grad, buffer);
  write(job.param, at, param, scratch);
  if (has_buffer) write(job.momentum_buffer, at, buffer, scratch);
}

}  // namespace

cudaError_t launch(const std::vector<AdamJob>& jobs, const AdamStep& step, cudaStream_t stream) {
  return launch_batches(adam_kernel, jobs, kBlock, stream, step);
}

cudaError_t launch(const std::vector<SgdJob>& jobs, const SgdStep& step, cudaStream_t stream) {
  return launch_batches(sgd_kernel, jobs, kBlock, stream, step);
}

}  // namespace amp::detail::widened_step
