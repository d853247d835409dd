// Private: the fused multi-tensor work of one scale_loss guard's unscale,
// over every slot of every optimizer the guard covers.
//
// For each slot with a gradient from this backward ("fresh": the scratch
// gradient with master weights, else the parameter's new .grad) or an
// accumulator set aside when the guard opened, the new accumulator is
//   fresh/scale + aside          (aside holds true values)
//   (fresh + aside)/scale        (aside still scaled: an accumulation ends)
//   fresh + aside, kept scaled   (delay_unscale)
// computed by a fixed sequence of ATen foreach calls, one per kind of work,
// with the inf/NaN check fused into the unscale (of this backward's values:
// asides were judged by their own guard). Asides stay untouched, so the guard
// can still unwind to them.
#pragma once

#include "gradient_lifecycle.h"

#include <amp/loss_scaler.h>

#include <vector>

namespace amp::detail {

class UnscalePlan {
 public:
  // `aside_scaled`: the slot's aside holds values scaled by this loss's
  // scaler (delay_unscale accumulation in progress).
  void add(ParamSlot& slot, bool aside_scaled);

  // Computes the new accumulators and installs them, freeing scratch
  // gradients. With `scaler`, unscales them and sets `found_inf` (a
  // 1-element float32 tensor on the scale's device) when any scaled value
  // is inf or NaN; without (delay_unscale, or a static
  // scale of 1 without masters), leaves values as they are.
  void run(LossScaler* scaler, at::Tensor& found_inf);

 private:
  struct Item {
    ParamSlot* slot;
    at::Tensor fresh;   // this backward's gradient, scaled (undefined if none)
    at::Tensor result;  // the new accumulator
    bool aside_scaled;
  };
  std::vector<Item> items_;
};

}  // namespace amp::detail
