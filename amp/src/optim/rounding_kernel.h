// SPDX-License-Identifier: BSD-3-Clause
// Private: O6's stochastic rounding of many CUDA tensors in one kernel
// launch (rounding_kernel.cu; compiled where the build has a CUDA compiler,
// which defines AMP_WITH_CUDA_KERNELS). The ATen ops round a tensor in six
// launches (its noise by at::randint, the add, the mask, the NaNs, the
// conversion); a widened step rounds its parameters and their bfloat16
// state tensor by tensor, so a chunk of small tensors cost hundreds.
//
// The bits are the ATen ops' (stochastic_rounding.h), tested side by side on
// a GPU: the noise is at::randint's draws from the CUDA generator seeded
// with the stream's seed - Philox4x32-10 through cuRAND, each value drawn
// by the thread, counter and lane ATen's distribution kernel
// (ATen/native/cuda/DistributionTemplates.h) would give it for a tensor of
// that size on this device - and the conversion is c10's.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace amp::detail {

// One tensor to round: dst (bfloat16) = src (float32, same numel), both
// contiguous on one CUDA device, with the noise of the stream `seed`.
struct CudaRounding {
  at::Tensor src, dst;
  uint64_t seed = 0;
};

// Whether `t` can be rounded by the kernel: the build has amp's CUDA
// kernels, compiled for t's device.
bool rounding_kernel_applies(const at::Tensor& t);
// Rounds every entry of `roundings` (all on one device, each rounding_kernel_applies):
// one launch for up to a few dozen tensors. No host sync.
void round_on_cuda(const std::vector<CudaRounding>& roundings);

}  // namespace amp::detail
