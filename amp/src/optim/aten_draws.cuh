// SPDX-License-Identifier: BSD-3-Clause
// Private, CUDA only: the draws ATen's distribution kernels
// (ATen/native/cuda/DistributionTemplates.h) give each value of a tensor,
// so amp's kernels (widened_step_kernels.h) draw what at::randint and
// at::rand draw from the CUDA generator seeded with a stream's seed.
//
// ATen launches blocks of 256 threads, at most as many as the device keeps
// resident; thread t's Philox4x32-10 subsequence is t, and pass p of its
// grid-stride loop takes counter p, whose four lanes are the values
// t + (4p + lane) * stride (stride: the grid's threads, which
// widened_step_kernels.cpp computes as calc_execution_policy does).
#pragma once

#include <curand_kernel.h>

#include <cstdint>

namespace amp::detail::aten_draws {

constexpr int kLanes = 4;

// The Philox state of ATen's thread `thread` at pass `pass` (curand_init,
// then `pass` draws of four).
__device__ inline curandStatePhilox4_32_10_t state_at(uint64_t seed, int64_t thread, int64_t pass) {
  curandStatePhilox4_32_10_t state;
  curand_init(seed, static_cast<unsigned long long>(thread), static_cast<unsigned long long>(pass) * kLanes, &state);
  return state;
}

// at::randint(0, 2^16)'s draw for value `index` of a tensor drawn with
// `stride` threads: curand4's lane, modulo the range as random_from_to
// takes it. (A kernel whose thread takes all four lanes of a draw calls
// curand4 once instead.)
__device__ inline uint32_t randint16(uint64_t seed, int64_t index, int64_t stride) {
  curandStatePhilox4_32_10_t state = state_at(seed, index % stride, index / (kLanes * stride));
  const uint4 draw = curand4(&state);
  const uint32_t lanes[kLanes] = {draw.x, draw.y, draw.z, draw.w};
  return lanes[(index / stride) % kLanes] % 65536u;
}

// at::rand's float for value `index` of a tensor drawn with `stride`
// threads: curand_uniform4's lane, its (0, 1] turned into [0, 1) as
// uniform_kernel turns it.
__device__ inline float uniform(uint64_t seed, int64_t index, int64_t stride) {
  curandStatePhilox4_32_10_t state = state_at(seed, index % stride, index / (kLanes * stride));
  const float4 draw = curand_uniform4(&state);
  const float lanes[kLanes] = {draw.x, draw.y, draw.z, draw.w};
  const float u = lanes[(index / stride) % kLanes];
  return u == 1.0f ? 0.0f : u;
}

}  // namespace amp::detail::aten_draws
