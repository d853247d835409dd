// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// LossScaler: one loss's scale, dynamic or static, kept on the gradients'
/// device.
///
/// amp creates one scaler per loss (Options::num_losses) and drives it from the
/// scale_loss guard; most users never touch it directly. Read the current scale
/// with amp::loss_scaler(loss_id)->scale() or, inside a guard, scale_loss::loss_scale().
///
/// Dynamic scaling (Apex/GradScaler defaults): start at 2**16; on an overflow
/// (inf/NaN in the gradients) the step is skipped and the scale multiplied by
/// backoff_factor (after `hysteresis` overflows, Megatron-style), never below
/// min_loss_scale (or 2**-126 without one); after growth_interval clean steps
/// it is multiplied by growth_factor, never above max_loss_scale. A static
/// scale never changes and never skips.
///
/// The scale, the growth tracker and the hysteresis tracker are tensors on the
/// device of the first loss scaled, updated there by `at::_amp_update_scale_`
/// (or equivalent tensor ops with hysteresis): updating needs no host sync.
/// Unscaling is one `at::_amp_foreach_non_finite_check_and_unscale_` per
/// (device, dtype) group of gradients.
///
/// The dynamic knobs can be changed while training, as GradScaler's
/// set_growth_factor & co. (they apply from the next update and are saved
/// with amp's state):
///
/// ```
///   amp::loss_scaler()->set_growth_interval(500);     // grow faster from now on
///   amp::loss_scaler()->dynamic_scaling().growth_interval;  // 500
/// ```
#pragma once

#include <amp/opt_levels.h>

#include <ATen/core/Tensor.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <vector>

namespace amp {
namespace internal {
class LossScaling;
}  // namespace internal

/// One loss's scale, dynamic or static, kept on the gradients' device.
/// Every scaler is created by amp (one per loss); programs reach them with
/// amp::loss_scaler(loss_id).
class LossScaler {
 public:
  int loss_id() const { return loss_id_; }  ///< the loss this scaler scales (scale_loss's loss_id)
  bool dynamic() const { return dynamic_; }  ///< whether the scale is dynamic (false: static)

  /// Where the scale lives (the device of the first loss scaled; CPU before).
  c10::Device device() const { return scale_.device(); }
  /// Host values: each reads the device (a sync); for logs, tests, checkpoints.
  double scale() const;  ///< the current scale
  int64_t growth_tracker() const;  ///< a host value: clean steps since the last overflow or growth
  int64_t hysteresis_tracker() const;  ///< a host value: overflows still tolerated before the scale backs off

  /// The floor an overflow cannot push the scale below.
  double floor() const;
  const DynamicScaling& dynamic_scaling() const { return options_; }  ///< the dynamic knobs now

  /// Replaces the dynamic knobs from the next update on. A hysteresis tracker
  /// above a smaller new hysteresis is lowered to it. Errors (c10::Error,
  /// nothing changes): a value check_dynamic_scaling refuses (opt_levels.h);
  /// a static scaler (its scale never changes: the knobs would do nothing).
  void set_dynamic_scaling(const DynamicScaling& scaling);
  /// Single knobs, with GradScaler's names; errors as set_dynamic_scaling.
  void set_growth_factor(double factor);  ///< sets DynamicScaling::growth_factor
  void set_backoff_factor(double factor);  ///< sets DynamicScaling::backoff_factor; errors as set_dynamic_scaling
  void set_growth_interval(int64_t steps);  ///< sets DynamicScaling::growth_interval; errors as set_dynamic_scaling

  /// Writes the scale, both trackers, static/dynamic and the dynamic knobs.
  void save(torch::serialize::OutputArchive& archive) const;
  /// Restores what save wrote; the knobs too, when the archive has them
  /// (archives written before they were saved keep the current knobs).
  /// Errors: a missing or mistyped entry, a scale that is not finite and
  /// positive, a negative growth tracker, knobs out of range, or a
  /// static/dynamic mismatch with this scaler; the scaler is unchanged when
  /// loading fails.
  void load(torch::serialize::InputArchive& archive);

 private:
  // The guard's side (scale, unscale, update, undo) is amp's own:
  // amp/internal/loss_scaling.h, the only kind of scaler amp makes.
  friend class internal::LossScaling;
  LossScaler(LossScale loss_scale, DynamicScaling dynamic, int loss_id);

  int loss_id_;
  bool dynamic_;
  DynamicScaling options_;
  at::Tensor scale_;               // float32 [1]
  at::Tensor growth_tracker_;      // int32 [1]
  at::Tensor hysteresis_tracker_;  // int32 [1]
};

}  // namespace amp
