// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// How many bytes LibTorch's allocator holds for tensors, now and at its
/// peak: what mixed precision and recomputation save, measured.
///
/// ```
///   amp::track_allocations();                 // once, before building the model
///   ...
///   amp::reset_peak_allocated();              // CPU; or reset_peak_allocated(torch::kCUDA)
///   train_step();
///   amp::AllocatedBytes bytes = amp::allocated_bytes();
///   std::printf("peak %.1f MiB\n", bytes.peak / 1048576.0);
/// ```
///
/// CPU: LibTorch keeps no count, so track_allocations() puts a counting
/// allocator in front of LibTorch's CPU allocator for the rest of the
/// process; tensors allocated before are not counted (their bytes never
/// enter `current`). Counting costs two atomic adds per allocation.
/// CUDA: the caching allocator's own statistics (bytes allocated to tensors,
/// not the cache it reserves); track_allocations() is not needed.
///
/// Errors (c10::Error): allocated_bytes / reset_peak_allocated for the CPU
/// before track_allocations(), or for a device type other than CPU and CUDA.
#pragma once

#include <torch/optim/optimizer.h>

#include <c10/core/Device.h>

#include <cstdint>

namespace amp {

/// Bytes LibTorch's allocator holds for tensors on one device.
struct AllocatedBytes {
  int64_t current = 0;  ///< held by live tensors now
  int64_t peak = 0;     ///< the most held at once since the last reset
};

/// Starts counting the CPU allocator's bytes. Idempotent; thread-safe.
void track_allocations();
/// Whether track_allocations() has been called: the CPU's bytes are counted.
bool tracking_allocations();

/// The bytes held for tensors on `device` (CPU, or a CUDA device: index 0
/// when none is given), now and at the peak.
AllocatedBytes allocated_bytes(c10::Device device = c10::kCPU);
/// The peak becomes the current count.
void reset_peak_allocated(c10::Device device = c10::kCPU);

/// What this rank holds for `optimizer` (passed to amp::initialize), in
/// bytes, measured from the tensors themselves (each storage once): what the
/// optimizer steps (O2's float32 masters, or with shard this rank's pieces),
/// its state, and the gradients of those and of the model's parameters;
/// `weights`: the low-precision copies forward computes with where the
/// optimizer steps something else (O2/O5's beside their masters while a
/// forward or backward holds them - freed when the guard unscales, so 0
/// between iterations; the gathered weights under shard - with shard_weights only those gathered now; 0 where it steps
/// them itself: O0, O1, O3, O6). `parameters` counts the elements of the whole parameters it trains,
/// for bytes per parameter. Errors: amp is not initialized; an optimizer not
/// passed to it.
struct TrainingBytes {
  int64_t weights = 0;          ///< the low-precision copies forward computes with (see above)
  int64_t masters = 0;          ///< what the optimizer steps: its parameter groups' tensors
  int64_t optimizer_state = 0;  ///< the optimizer's state tensors
  int64_t gradients = 0;        ///< the gradients of what it steps and of the model's parameters
  int64_t parameters = 0;       ///< elements of the whole parameters it trains
};
/// What this rank holds for `optimizer` now, by kind (TrainingBytes).
TrainingBytes training_bytes(const torch::optim::Optimizer& optimizer);

}  // namespace amp
