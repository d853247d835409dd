// SPDX-License-Identifier: BSD-3-Clause
// Private: hooks that run after a leaf's gradient accumulator, removed
// together - how data-parallel reduction learns a gradient is final, and
// how the step in backward applies it.
//
// The autograd engine sums every path into a leaf before its accumulator
// runs, once per backward, so the hook sees the gradient whole.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace amp::detail {

class AccumulatorHooks {
 public:
  AccumulatorHooks() = default;
  AccumulatorHooks(const AccumulatorHooks&) = delete;
  AccumulatorHooks& operator=(const AccumulatorHooks&) = delete;
  ~AccumulatorHooks() { clear(); }

  // Runs `on_gradient` after each accumulation into `leaf`'s .grad. False
  // (nothing hooked) when `leaf` has no accumulator: it is in no live
  // graph, so backward cannot produce its gradient.
  bool add(const at::Tensor& leaf, std::function<void()> on_gradient);
  // Removes every hook (the nodes outlive a guard: a retained graph).
  void clear() noexcept;

 private:
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
};

}  // namespace amp::detail
