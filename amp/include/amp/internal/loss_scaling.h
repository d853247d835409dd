// SPDX-License-Identifier: BSD-3-Clause
// Internal: the loss scaler as the scale_loss guard drives it - the scale on
// the loss's device, unscaling with the overflow check, the update, and the
// undo an exception needs. Not part of the API: programs read and tune a
// scale through amp::LossScaler (loss_scaler.h).
#pragma once

#include <amp/loss_scaler.h>

#include <ATen/core/Tensor.h>

#include <vector>

namespace amp::internal {

class LossScaling : public LossScaler {
 public:
  LossScaling(LossScale loss_scale, DynamicScaling dynamic, int loss_id = 0);

  // The scale as a 1-element float32 tensor on `device` (moved there, with
  // both trackers, on the first call with a new device).
  const at::Tensor& scale_tensor(c10::Device device);
  // The same scale viewed in `shape` (one element: a loss's shape), made
  // without an op and kept while the scale tensor stays the same.
  const at::Tensor& scale_as(c10::Device device, at::IntArrayRef shape);

  // Multiplies `grads` in place by 1/scale (float32's reciprocal: the float
  // GradScaler's double reciprocal rounds to) and sets `found_inf` (a
  // 1-element float32 tensor on
  // the scale's device) to 1 if any of them holds an inf or NaN. A sparse
  // gradient has its values unscaled; in float16 the sums of its duplicate
  // indices are checked too (on a coalesced copy), as GradScaler does.
  void unscale(const std::vector<at::Tensor>& grads, at::Tensor& found_inf);

  // A guard's verdict in the making, on the scale's device for `device`:
  // three float32 zeros, to become [found_inf, scale before, scale after] -
  // the snapshot that the one deferred host read decides a skip from.
  at::Tensor new_verdict(c10::Device device);
  // The verdict's first element, as the 1-element tensor unscale() sets.
  static at::Tensor overflow_flag(const at::Tensor& verdict);
  // Updates the scale from the verdict's flag (`found_inf`, its
  // overflow_flag) without a host sync, and writes the scale before and
  // after into the verdict.
  void update(const at::Tensor& verdict, const at::Tensor& found_inf);
  void update(const at::Tensor& verdict) { update(verdict, overflow_flag(verdict)); }

  // A copy of the device state, to undo an update (an exception ending a
  // guard after unscale()). Copies stay on the device: no host sync.
  struct State {
    at::Tensor scale, growth_tracker, hysteresis_tracker;
  };
  State state() const;
  void restore(const State& state);

 private:
  void update_with_hysteresis(const at::Tensor& found_inf);
  // The scale (on the CPU) clamped to [floor(), max_loss_scale] in place,
  // read and written through its pointer.
  void clamp_on_cpu();

  // The last verdict made, reused by new_verdict once no one holds it; made
  // with the scale (and moved with it), so a step allocates none.
  at::Tensor spare_verdict_;
  at::Tensor scale_view_;     // scale_as's last view
};

// The live initialization's scaler of `loss_id`, its guard side (for tests
// and tools that drive or inspect the mechanics). Errors: amp is not
// initialized; loss_id out of range.
LossScaling& live_scaling(int loss_id = 0);

}  // namespace amp::internal
