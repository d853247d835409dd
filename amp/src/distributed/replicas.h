// SPDX-License-Identifier: BSD-3-Clause
// Private: making every rank's models the same replica at initialize
// (Options::data_parallel), as DDP does when it wraps a module.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/nn/module.h>

#include <cstdint>
#include <vector>

namespace amp::detail {

// Overwrites every parameter and buffer of `models` with rank 0's values:
// one broadcast per dtype, of the tensors flattened together. A collective:
// every rank calls it with the same models.
void broadcast_from_rank0(const std::vector<torch::nn::Module*>& models, c10d::Backend& group);

// Rank 0's `seed` (a collective), for what replicas draw alike.
uint64_t rank0_seed(uint64_t seed, c10d::Backend& group);

}  // namespace amp::detail
