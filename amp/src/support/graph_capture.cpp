// SPDX-License-Identifier: BSD-3-Clause
#include "support/graph_capture.h"

#ifdef AMP_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace amp::detail {

bool capturing(c10::Device device) {
#ifdef AMP_WITH_CUDA
  if (!device.is_cuda()) return false;
  // Allowed during a capture, unlike a query of an event or a stream.
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()), &status));
  return status != cudaStreamCaptureStatusNone;
#else
  (void)device;
  return false;
#endif
}

}  // namespace amp::detail
