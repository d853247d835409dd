// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// For programs that average gradients themselves (their own DDP loop):
/// amp's part is to make every rank skip the same steps. amp's built-in data
/// parallel is Options::data_parallel (data_parallel.h).
#pragma once

#include <amp/data_parallel.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>

namespace amp {

/// For loops that all-reduce gradients themselves: combines every rank's
/// overflow flag (MAX) before the scale update, so all ranks skip together.
///
///   options.reduce_overflow = amp::overflow_all_reduce(process_group);
///
/// Where to reduce gradients then: after the guard and before step()
/// (unscaled; at O2 the fp32 master gradients), or inside the guard after
/// backward() (the scaled gradients, as DDP's hooks do). Errors: a null
/// process group.
std::function<void(at::Tensor&)> overflow_all_reduce(c10::intrusive_ptr<c10d::Backend> group);

}  // namespace amp
