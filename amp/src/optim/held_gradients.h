// SPDX-License-Identifier: BSD-3-Clause
// Private: gradients amp keeps off their parameters for a while, then gives
// back or sums in. Every place the step holds a gradient away from its
// optimizer:
//
//   holder                   holds                                  until
//   -----------------------  -------------------------------------  ----------------------------
//   each optimizer's         its parameters' accumulated            the iteration ends, or
//   iteration record         gradients, the one place they are      a guard's commit or unwind
//   (OptimizerStep, a        kept: from a guard's opening, what     (given back on unwind; the
//   HeldGradients)           each had (true values, or an           unscale summed them in on
//                            accumulation's scaled sum; the         commit)
//                            guard's GradSlot::aside reads it);
//                            between delay_unscale guards, the
//                            scaled sum - over ZeRO-1
//                            (shard_gradients=false) each member's
//                            float32 sum, which the accumulation's
//                            last guard reduces with its own
//   Guard (a HeldGradients)  other optimizers' master gradients     the guard commits or unwinds
//                            while it runs (its backward leaves
//                            scratch scaled by its loss on them)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/flat_hash_map.h>

#include <utility>
#include <vector>

namespace amp::detail {

class HeldGradients {
 public:
  // Takes `param`'s gradient off it; one it has none is held too, and is
  // given back as none. A parameter held already keeps what is held (what
  // it carries now is dropped). Returns what is held for it. Cannot fail
  // once reserve() made room for it.
  const at::Tensor& take(const at::Tensor& param);
  // take() for a parameter the caller knows is not held (a guard setting
  // each of its parameters aside once, over an empty hold): no lookup, and
  // no index kept until one is needed.
  const at::Tensor& take_new(const at::Tensor& param);
  // Holds `grad` for `param` (whose own gradient is left alone), replacing
  // what is held for it. Cannot fail once reserve() made room for it.
  void put(const at::Tensor& param, at::Tensor grad);
  // What is held for `param` (undefined: nothing).
  at::Tensor find(const at::Tensor& param) const;
  // Room for `more` gradients beside those held now.
  void reserve(size_t more);
  // Gives each held gradient back to its parameter (replacing what it has);
  // the hold is empty then.
  void give_back() noexcept;
  // Drops everything held (summed in elsewhere, or discarded).
  void clear() noexcept;
  bool empty() const { return held_.empty(); }

 private:
  // Indexes every held entry (take_new leaves them out).
  void index_all();

  std::vector<std::pair<at::Tensor, at::Tensor>> held_;  // (parameter, its gradient)
  ska::flat_hash_map<const c10::TensorImpl*, size_t> index_;  // parameter -> its place in held_
  size_t indexed_ = 0;  // held_[0, indexed_) are in index_
};

}  // namespace amp::detail
