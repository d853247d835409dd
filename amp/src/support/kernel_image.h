// SPDX-License-Identifier: BSD-3-Clause
// Private, CUDA builds only: whether one of amp's kernels can run on a device.
#pragma once

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <atomic>
#include <cstdint>

namespace amp::detail {

// Whether `kernel` was built for device `index`'s architecture (SASS for it,
// or PTX it compiles; AMP_CUDA_ARCHITECTURES chooses them), -1 the current
// device: asked of the CUDA runtime once per device, the answer kept in
// `answers` (0 not asked yet, 1 runs, 2 does not). Read on every call, so
// no lock: two threads asking at once get the same answer.
template <class Kernel>
bool has_image_for(Kernel* kernel, c10::DeviceIndex index, std::array<std::atomic<uint8_t>, 64>& answers) {
  if (index < 0) index = c10::cuda::current_device();
  std::atomic<uint8_t>& answer = answers.at(static_cast<size_t>(index));
  if (const uint8_t known = answer.load(std::memory_order_relaxed)) return known == 1;
  const c10::cuda::CUDAGuard device(index);
  cudaFuncAttributes attributes;
  const bool image = cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess;
  if (!image) (void)cudaGetLastError();  // the lookup's error is an answer, not a fault to report later
  answer.store(image ? 1 : 2, std::memory_order_relaxed);
  return image;
}

}  // namespace amp::detail
