// SPDX-License-Identifier: BSD-3-Clause
// Private: the fused multi-tensor work of one scale_loss guard's unscale,
// over every parameter of every optimizer the guard covers.
//
// For each slot with a gradient from this backward ("fresh": the
// parameter's .grad after backward) or a gradient set aside when the guard
// opened, the new gradient, in the slot's gradient dtype (float32 for O2's
// master weights, whose fresh gradients are low-precision scratch), is
//   fresh/scale + aside          (aside holds true values)
//   (fresh + aside)/scale        (aside still scaled: an accumulation ends)
//   fresh + aside, kept scaled   (delay_unscale)
// computed by a fixed sequence of ATen foreach calls, one per kind of work,
// with the inf/NaN check fused into the unscale (of this backward's values:
// asides were judged by their own guard). Asides stay untouched, so the guard
// can still unwind to them. Where scratch gradients are copied into another
// dtype the sequence runs over slices (an eighth of the copies' bytes, 1 MiB
// at least), each freeing its scratch gradients, so the float32 gradients
// and the scratch ones are never held whole together.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace amp::detail {

// One parameter a guard covers.
struct GradSlot {
  at::Tensor param;
  // Its gradient when the guard opened: what its optimizer's record holds
  // (held_gradients.h), which gives it back if the guard unwinds.
  at::Tensor aside;
  at::ScalarType grad_dtype = at::kFloat;  // the dtype its gradient is kept in
  bool aside_scaled = false;  // the aside holds values scaled by this loss (delay_unscale)
  // The data-parallel average already includes the scaled aside (it was
  // reduced with the fresh gradient); the plan leaves it out.
  bool aside_reduced = false;
};

class UnscalePlan {
 public:
  explicit UnscalePlan(std::vector<GradSlot>& slots);

  // Computes the new gradients and installs them as the parameters' .grad,
  // dropping the scratch ones. `unscale` (the loss scaler's, from the step
  // layer; called once per slice) divides the scaled ones by the scale in
  // place and checks them for inf/NaN, accumulating into one flag; empty
  // (delay_unscale, or a static scale of 1 without masters): values stay
  // as they are.
  using Unscale = std::function<void(const std::vector<at::Tensor>& scaled)>;
  void run(const Unscale& unscale);

 private:
  struct Item {
    GradSlot* slot;
    at::Tensor fresh;   // this backward's gradient, scaled (undefined if none)
    at::Tensor aside;   // the slot's aside, unless already reduced into fresh
    at::Tensor result;  // the new gradient
  };
  struct Slice {
    Item* first;
    Item* last;
    Item* begin() const { return first; }
    Item* end() const { return last; }
  };
  void run_slice(Slice items, const Unscale& unscale);
  std::vector<Item> items_;
};

}  // namespace amp::detail
