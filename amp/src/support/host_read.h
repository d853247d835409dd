// SPDX-License-Identifier: BSD-3-Clause
// Private: reading records that stayed on the device, when the host needs
// them (an overflow report, telemetry asked for).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace amp::detail {

// The values of `tensors`, each flattened, in order, as float64: one copy
// to the host per device they live on, counted in amp::host_syncs.
std::vector<double> read_to_host(const std::vector<at::Tensor>& tensors);

// Counts a wait for the device (amp::host_syncs).
void count_host_read();
// The waits counted so far.
int64_t host_reads();

}  // namespace amp::detail
