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
  LossScaling(LossScale loss_scale, DynamicScaling dynamic, int loss_id = 0)
      : LossScaler(loss_scale, dynamic, loss_id) {}

  // The scale as a 1-element float32 tensor on `device` (moved there, with
  // both trackers, on the first call with a new device).
  const at::Tensor& scale_tensor(c10::Device device);

  // Multiplies `grads` in place by 1/scale (float32's reciprocal: the float
  // GradScaler's double reciprocal rounds to) and sets `found_inf` (a
  // 1-element float32 tensor on
  // the scale's device) to 1 if any of them holds an inf or NaN. A sparse
  // gradient has its values unscaled; in float16 the sums of its duplicate
  // indices are checked too (on a coalesced copy), as GradScaler does.
  void unscale(const std::vector<at::Tensor>& grads, at::Tensor& found_inf);

  // Updates the scale from `found_inf` without a host sync. Returns a
  // 3-element float32 snapshot [found_inf, scale before, scale after] for the
  // one deferred host read that decides whether the step is skipped.
  at::Tensor update(const at::Tensor& found_inf);

  // A copy of the device state, to undo an update (an exception ending a
  // guard after unscale()). Copies stay on the device: no host sync.
  struct State {
    at::Tensor scale, growth_tracker, hysteresis_tracker;
  };
  State state() const;
  void restore(const State& state);

 private:
  void update_with_hysteresis(const at::Tensor& found_inf);
};

// The live initialization's scaler of `loss_id`, its guard side (for tests
// and tools that drive or inspect the mechanics). Errors: amp is not
// initialized; loss_id out of range.
LossScaling& live_scaling(int loss_id = 0);

}  // namespace amp::internal
