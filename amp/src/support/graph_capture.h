// SPDX-License-Identifier: BSD-3-Clause
// Private: whether work queued now on a device is being captured into a CUDA
// graph rather than run. A captured step runs again on every replay without
// the host, so amp must not read or wait for the device then (a query or a
// wait invalidates the capture) and keeps on the device what replays tell.
#pragma once

#include <c10/core/Device.h>

namespace amp::detail {

// True while the current stream of `device` (a CUDA device) is capturing.
// Always false for other devices and where LibTorch has no CUDA.
bool capturing(c10::Device device);

}  // namespace amp::detail
