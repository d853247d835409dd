// SPDX-License-Identifier: BSD-3-Clause
#include "optim/widened_step_kernels.h"

#include "optim/aten_draws.cuh"
#include "optim/kernel_jobs.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

namespace amp::detail {
namespace {

constexpr int kBlock = 256;            // values a packed row codes (eight_bit_state.h's kStateBlock)
constexpr int kRow = kBlock + 1;       // its codes, then its exponent
constexpr int kMinExponent = -126, kMaxExponent = 127, kNonFiniteBlock = -128;
static_assert(kBlock == aten_draws::kThreads);

struct Job {
  const float* values;
  uint8_t* packed;
  const float* table;  // the code values, ascending
  int64_t numel;
  int64_t stride;       // at::rand's grid threads for the [rows, 256] noise
  int64_t first_block;  // this launch's first block for the job: one block a row
  uint64_t seed;
  int last;             // the table's last index
  int zero;             // the code of 0
  int steps;            // codes per doubling
  bool stochastic;
};

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
__global__ void __launch_bounds__(kBlock) pack_kernel(const KernelJobs<Job> jobs) {
  __shared__ float scratch[kBlock / 32];
  const Job& job = job_of_block(jobs);
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

void launch_packing(const KernelJobs<Job>& jobs, int64_t blocks) {
  pack_kernel<<<static_cast<unsigned int>(blocks), kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(jobs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct DecodeJob {
  const uint8_t* packed;
  float* values;
  const float* table;
  int64_t numel;
  int64_t first_block;
  int last;
};

// One block a packed row, one thread a value: unpack_by_aten_ops'
// table[code] * 2^exponent, NaN for a non-finite row's. A code past the
// table (damaged state, which the CPU refuses) decodes as NaN: a kernel
// cannot raise an error without the host waiting for it.
__global__ void __launch_bounds__(kBlock) unpack_kernel(const KernelJobs<DecodeJob> jobs) {
  const DecodeJob& job = job_of_block(jobs);
  const int64_t row = static_cast<int64_t>(blockIdx.x) - job.first_block;
  const int64_t i = row * kBlock + threadIdx.x;
  if (i >= job.numel) return;
  const uint8_t* in = job.packed + row * kRow;
  const int code = in[threadIdx.x], e = static_cast<int8_t>(in[kBlock]);
  const float nan = __int_as_float(0x7FC00000);  // masked_fill's quiet NaN
  const float scale = e == kNonFiniteBlock ? nan : __int_as_float((max(e, kMinExponent) + 127) << 23);
  job.values[i] = __fmul_rn(code <= job.last ? job.table[code] : nan, scale);
}

void launch_unpacking(const KernelJobs<DecodeJob>& jobs, int64_t blocks) {
  unpack_kernel<<<static_cast<unsigned int>(blocks), kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(jobs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void pack_on_cuda(const std::vector<CudaPacking>& packings) {
  if (packings.empty()) return;
  const c10::cuda::CUDAGuard device(packings.front().values.device());  // at::rand's grid is this device's
  JobBatch<Job, decltype(&launch_packing)> batch(&launch_packing);
  for (const CudaPacking& p : packings) {
    const int64_t numel = p.values.numel(), rows = (numel + kBlock - 1) / kBlock;
    TORCH_INTERNAL_ASSERT(p.values.scalar_type() == at::kFloat && p.values.is_contiguous() &&
                          p.packed.scalar_type() == at::kByte && p.packed.is_contiguous() &&
                          p.packed.numel() == rows * kRow && p.table.scalar_type() == at::kFloat &&
                          p.values.device() == packings.front().values.device() &&
                          p.packed.device() == p.values.device() && p.table.device() == p.values.device(),
                          "amp: the CUDA state coding kernel got an unfit tensor");
    if (rows == 0) continue;
    const int last = static_cast<int>(p.table.numel()) - 1;
    batch.add({p.values.const_data_ptr<float>(), p.packed.mutable_data_ptr<uint8_t>(), p.table.const_data_ptr<float>(),
               numel, aten_draws::grid_threads(rows * kBlock), 0, p.seed.value_or(0), last,
               p.non_negative ? 0 : last / 2, p.non_negative ? 4 : 8, p.seed.has_value()},
              rows);
  }
  batch.flush();
}

void unpack_on_cuda(const std::vector<CudaUnpacking>& unpackings) {
  if (unpackings.empty()) return;
  const c10::cuda::CUDAGuard device(unpackings.front().values.device());
  JobBatch<DecodeJob, decltype(&launch_unpacking)> batch(&launch_unpacking);
  for (const CudaUnpacking& u : unpackings) {
    const int64_t numel = u.values.numel(), rows = (numel + kBlock - 1) / kBlock;
    TORCH_INTERNAL_ASSERT(u.values.scalar_type() == at::kFloat && u.values.is_contiguous() &&
                          u.packed.scalar_type() == at::kByte && u.packed.is_contiguous() &&
                          u.packed.numel() == rows * kRow && u.table.scalar_type() == at::kFloat &&
                          u.values.device() == unpackings.front().values.device() &&
                          u.packed.device() == u.values.device() && u.table.device() == u.values.device(),
                          "amp: the CUDA state decoding kernel got an unfit tensor");
    if (rows == 0) continue;
    batch.add({u.packed.const_data_ptr<uint8_t>(), u.values.mutable_data_ptr<float>(), u.table.const_data_ptr<float>(),
               numel, 0, static_cast<int>(u.table.numel()) - 1},
              rows);
  }
  batch.flush();
}

}  // namespace amp::detail
