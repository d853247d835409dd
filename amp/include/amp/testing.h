// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Measurement and test hooks: what benchmarks and tests read or set. A
/// training program needs none of them.
///
/// ```
///   #include <amp/testing.h>
///   const int64_t before = amp::host_syncs();
///   ... train a step ...
///   assert(amp::host_syncs() == before);  // a fused step on a GPU: no wait
/// ```
#pragma once

#include <amp/hardware.h>

#include <cstdint>
#include <optional>

namespace amp {

/// How many times the host has waited for the device to learn whether a step
/// is skipped: once per step() of an optimizer that runs its own step after
/// reading the verdict; never for a fused step (optimizer.h), whose kernel
/// decides on the device, unless its outcome is asked for before it reached
/// the host (last_step_skipped, skipped_steps, a checkpoint; on a GPU only).
/// A loss on the CPU with gradients on a GPU costs one more per device each
/// unscale (the overflow flag lives beside the loss): keep the loss on the
/// GPU. Monotonic.
int64_t host_syncs();

/// Makes cpu_precision() report `cpu` (nullopt: the real CPU again), to test
/// the choices amp makes on other CPUs. Takes effect at the next
/// amp::initialize.
void set_cpu_precision_for_testing(std::optional<CpuPrecision> cpu);

}  // namespace amp
