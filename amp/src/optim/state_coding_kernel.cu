// SPDX-License-Identifier: BSD-3-Clause
#include "optim/widened_step_launch.h"

#include "optim/aten_draws.cuh"
#include "optim/kernel_jobs.cuh"

#include <cstdint>

namespace amp::detail::widened_step {
namespace {

constexpr int kBlock = 256;            // values a packed row codes (eight_bit_state.h's kStateBlock)
constexpr int kRow = kBlock + 1;       // its codes, then its exponent
constexpr int kMinExponent = -126, kMaxExponent = 127, kNonFiniteBlock = -128;
static_assert(kBlock == kThreads);

// The largest of the block's `v` (every thread's answer), through `scratch`.
__device__ float block_max(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();  // scratch's last readers are done
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kBlock / 32; ++w) v = fmaxf(v, scratch[w]);
  return v;
}

// One block a packed row, one thread a value: code_blocks
// (eight_bit_state.cpp) as the ATen ops compute it, in the same float32
// operations, so the bytes are theirs.
__global__ void __launch_bounds__(kBlock) pack_kernel(const KernelJobs<PackingJob> jobs) {
  __shared__ float scratch[kBlock / 32];
  const PackingJob& job = job_of_block(jobs);
  const int64_t row = static_cast<int64_t>(blockIdx.x) - job.first_block;
  const int64_t i = row * kBlock + threadIdx.x;
  const float x = i < job.numel ? job.values[i] : 0.0f;  // the last row padded with zeros
  const bool non_finite = __syncthreads_or(!isfinite(x));
  // The smallest power of two holding the row's maximum.
  int exponent = 0;
  const float mantissa = frexpf(block_max(fabsf(x), scratch), &exponent);
  int e = min(max(exponent - (mantissa == 0.5f ? 1 : 0), kMinExponent), kMaxExponent);
  const float y = fminf(fmaxf(__fdiv_rn(x, __int_as_float((e + 127) << 23)), job.zero == 0 ? 0.0f : -1.0f), 1.0f);
  // The neighbouring codes a <= y <= b: bucketize(right) - 1, clamped.
  int first = 0, count = job.last + 1;  // upper bound: the first entry above y
  while (count > 0) {
    const int half = count / 2;
    if (job.table[first + half] <= y) {
      first += half + 1;
      count -= half + 1;
    } else {
      count = half;
    }
  }
  const int lo = min(max(first - 1, 0), job.last), hi = min(lo + 1, job.last);
  const float a = job.table[lo], b = job.table[hi];
  const bool up = job.stochastic
                      ? __fmul_rn(aten_draws::uniform(job.seed, i, job.stride), __fsub_rn(b, a)) < __fsub_rn(y, a)
                      : __fsub_rn(y, a) > __fsub_rn(b, y);
  int code = lo + (up ? 1 : 0);
  // A row whose maximum rounded down onto 0.5 is coded one exponent down.
  const bool halve = block_max(fabsf(up ? b : a), scratch) == 0.5f && e > kMinExponent;
  if (halve) code += (job.zero == 0 ? (code > 0) : (code > job.zero) - (code < job.zero)) * job.steps;
  if (halve) e -= 1;
  uint8_t* out = job.packed + row * kRow;
  out[threadIdx.x] = non_finite ? 0 : static_cast<uint8_t>(code);
  if (threadIdx.x == 0) out[kBlock] = static_cast<uint8_t>(static_cast<int8_t>(non_finite ? kNonFiniteBlock : e));
}

// One block a packed row, one thread a value: unpack_by_aten_ops'
// table[code] * 2^exponent, NaN for a non-finite row's. A code past the
// table (damaged state, which the CPU refuses) decodes as NaN: a kernel
// cannot raise an error without the host waiting for it.
__global__ void __launch_bounds__(kBlock) unpack_kernel(const KernelJobs<UnpackingJob> jobs) {
  const UnpackingJob& job = job_of_block(jobs);
  const int64_t row = static_cast<int64_t>(blockIdx.x) - job.first_block;
  const int64_t i = row * kBlock + threadIdx.x;
  if (i >= job.numel) return;
  const uint8_t* in = job.packed + row * kRow;
  const int code = in[threadIdx.x], e = static_cast<int8_t>(in[kBlock]);
  const float nan = __int_as_float(0x7FC00000);  // masked_fill's quiet NaN
  const float scale = e == kNonFiniteBlock ? nan : __int_as_float((max(e, kMinExponent) + 127) << 23);
  job.values[i] = __fmul_rn(code <= job.last ? job.table[code] : nan, scale);
}

}  // namespace

cudaError_t launch(const std::vector<PackingJob>& jobs, cudaStream_t stream) {
  return launch_batches(pack_kernel, jobs, kBlock, stream);
}

cudaError_t launch(const std::vector<UnpackingJob>& jobs, cudaStream_t stream) {
  return launch_batches(unpack_kernel, jobs, kBlock, stream);
}

}  // namespace amp::detail::widened_step
