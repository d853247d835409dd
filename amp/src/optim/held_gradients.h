// Private: gradients amp keeps off their parameters for a while, then gives
// back. Every place the step holds a gradient away from its optimizer:
//
//   holder                   holds                                  until
//   -----------------------  -------------------------------------  ----------------------------
//   OptimizerStep            an accumulation's scaled sum between   the guard that ends it
//   (a HeldGradients)        delay_unscale guards, so that a step()  opens
//                            in between changes nothing
//   Guard (a HeldGradients)  other optimizers' master gradients     the guard commits or unwinds
//                            while it runs (its backward leaves
//                            scratch scaled by its loss on them)
//   Guard's GradSlot::aside  its own parameters' gradients at its   the unscale sums them in; an
//   (unscale_plan.h)         opening, which the unscale reads       unwind gives them back
//   ReduceBucket (ZeRO-1:    each member's float32 sum of an        the accumulation's last guard
//   shard_gradients=false)   accumulation's earlier micro-batches   reduces them
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

namespace amp::detail {

class HeldGradients {
 public:
  // Takes `param`'s gradient off it; one it has none is held too, and is
  // given back as none (what backward left there is dropped). Cannot fail
  // once reserve() made room for it.
  void take(const at::Tensor& param);
  void reserve(size_t gradients) { held_.reserve(gradients); }
  // Gives each held gradient back to its parameter (replacing what it has);
  // the hold is empty then.
  void give_back() noexcept;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> held_;  // (parameter, its gradient)
};

}  // namespace amp::detail
