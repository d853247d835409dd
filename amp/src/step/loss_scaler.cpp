// SPDX-License-Identifier: BSD-3-Clause
#include <amp/internal/loss_scaling.h>
#include <amp/internal/level_rules.h>

#include "optim/non_finite_check.h"
#include "support/graph_capture.h"
#include "support/raw_view.h"
#include "support/trace_range.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <optional>

namespace amp {

using internal::LossScaling;

LossScaler::LossScaler(LossScale loss_scale, DynamicScaling dynamic, int loss_id)
    : loss_id_(loss_id), dynamic_(loss_scale.dynamic), options_(dynamic) {
  scale_ = at::full({1}, loss_scale.value, at::kFloat);
  growth_tracker_ = at::zeros({1}, at::kInt);
  hysteresis_tracker_ = at::full({1}, dynamic.hysteresis, at::kInt);
}

LossScaling::LossScaling(LossScale loss_scale, DynamicScaling dynamic, int loss_id)
    : LossScaler(loss_scale, dynamic, loss_id), spare_verdict_(at::zeros({3}, scale_.options())) {}

const at::Tensor& LossScaling::scale_tensor(c10::Device device) {
  if (scale_.device() != device) {
    scale_ = scale_.to(device);
    growth_tracker_ = growth_tracker_.to(device);
    hysteresis_tracker_ = hysteresis_tracker_.to(device);
    spare_verdict_ = at::zeros({3}, scale_.options());
  }
  return scale_;
}

const at::Tensor& LossScaling::scale_as(c10::Device device, at::IntArrayRef shape) {
  const at::Tensor& scale = scale_tensor(device);
  if (!scale_view_.defined() || !scale_view_.storage().is_alias_of(scale.storage()) ||
      scale_view_.storage_offset() != scale.storage_offset() || scale_view_.sizes() != shape) {
    scale_view_ = detail::raw_view(scale, 0, shape);
  }
  return scale_view_;
}

double LossScaler::scale() const { return scale_.item<double>(); }
int64_t LossScaler::growth_tracker() const { return growth_tracker_.item<int64_t>(); }
int64_t LossScaler::hysteresis_tracker() const { return hysteresis_tracker_.item<int64_t>(); }

double LossScaler::floor() const {
  return options_.min_loss_scale.value_or(std::numeric_limits<float>::min());
}

void LossScaling::unscale(const std::vector<at::Tensor>& grads, at::Tensor& found_inf) {
  if (grads.empty()) return;
  AMP_TRACE_RANGE("amp::unscale and inf/NaN check", grads);
  // GradScaler computes 1/scale in double, then rounds to float. float32's
  // own reciprocal is correctly rounded, and the same float for every
  // float32 scale: the double could round 1/scale onto a float's midpoint
  // only after 28 equal bits in a row, and 1/m (m < 2^24) has at most 23
  // (a remainder r of m makes the next bits those of r/m, r/m >= 1/m). All
  // 2^31 positive scales were checked once; LossScalerTest checks a sample.
  const at::Tensor inv_scale = scale_.reciprocal();
  detail::non_finite_check_and_unscale(grads, found_inf, inv_scale);
}

LossScaling::State LossScaling::state() const {
  return {scale_.clone(), growth_tracker_.clone(), hysteresis_tracker_.clone()};
}

void LossScaling::restore(const State& state) {
  scale_.copy_(state.scale);
  growth_tracker_.copy_(state.growth_tracker);
  hysteresis_tracker_.copy_(state.hysteresis_tracker);
}

at::Tensor LossScaling::new_verdict(c10::Device device) {
  const at::Tensor& scale = scale_tensor(device);
  if (detail::capturing(scale.device())) return at::zeros({3}, scale.options());  // the graph's own
  // The last verdict again once nothing else holds it (read, then dropped):
  // no allocation a step, and on the CPU no op. It is on the scale's device
  // (scale_tensor moves it); an undefined one has no uses.
  const bool unheld = spare_verdict_.use_count() == 1 && spare_verdict_.storage().use_count() == 1;
  if (!unheld) {
    spare_verdict_ = at::zeros({3}, scale.options());
  } else if (spare_verdict_.is_cpu()) {
    std::fill_n(spare_verdict_.mutable_data_ptr<float>(), 3, 0.0f);
  } else {
    spare_verdict_.zero_();
  }
  return spare_verdict_;
}

at::Tensor LossScaling::overflow_flag(const at::Tensor& verdict) { return detail::raw_view(verdict, 0, {1}); }

void LossScaling::clamp_on_cpu() {
  // As clamp_(lo, hi) computes it for a float tensor: min(max(scale, lo), hi)
  // with the bounds as floats.
  float& scale = *scale_.mutable_data_ptr<float>();
  const float lo = static_cast<float>(floor()), hi = static_cast<float>(options_.max_loss_scale);
  if (scale < lo) scale = lo;
  if (scale > hi) scale = hi;
}

void LossScaling::update(const at::Tensor& verdict, const at::Tensor& found_inf) {
  AMP_TRACE_RANGE("amp::scale update");
  TORCH_INTERNAL_ASSERT(verdict.numel() == 3 && verdict.is_contiguous() && verdict.device() == scale_.device() &&
                        verdict.scalar_type() == at::kFloat, "amp: a scale update takes a verdict of new_verdict");
  TORCH_INTERNAL_ASSERT(found_inf.storage().is_alias_of(verdict.storage()) &&
                        found_inf.storage_offset() == verdict.storage_offset() && found_inf.numel() == 1,
                        "amp: a scale update takes the verdict's own overflow flag");
  // On the CPU the scale is read and written in place, without ops.
  const bool on_cpu = scale_.is_cpu();
  float* snapshot = on_cpu ? verdict.mutable_data_ptr<float>() : nullptr;
  if (on_cpu) {
    snapshot[1] = *scale_.const_data_ptr<float>();
  } else {
    verdict.narrow(0, 1, 1).copy_(scale_);
  }
  if (dynamic_) {
    if (options_.hysteresis == 1) {
      at::_amp_update_scale_(scale_, growth_tracker_, found_inf, options_.growth_factor,
                             options_.backoff_factor, options_.growth_interval);
    } else {
      update_with_hysteresis(found_inf);
    }
    if (on_cpu) {
      clamp_on_cpu();
    } else {
      scale_.clamp_(floor(), options_.max_loss_scale);
    }
  }
  if (on_cpu) {
    snapshot[2] = *scale_.const_data_ptr<float>();
  } else {
    verdict.narrow(0, 2, 1).copy_(scale_);
  }
}

// Megatron's DynamicGradScaler.update, as tensor ops: an overflow resets the
// growth tracker and spends one unit of hysteresis; the scale backs off once
// hysteresis is spent; growth refills it.
void LossScaling::update_with_hysteresis(const at::Tensor& found_inf) {
  const at::Tensor found = found_inf > 0;
  hysteresis_tracker_.copy_(at::where(found, hysteresis_tracker_ - 1, hysteresis_tracker_));
  const at::Tensor back_off = found & (hysteresis_tracker_ <= 0);
  growth_tracker_.copy_(at::where(found, at::zeros_like(growth_tracker_), growth_tracker_ + 1));
  const at::Tensor grow = growth_tracker_ >= options_.growth_interval;
  const at::Tensor grown = scale_ * options_.growth_factor;
  scale_.copy_(at::where(back_off, scale_ * options_.backoff_factor, scale_));
  scale_.copy_(at::where(grow & at::isfinite(grown), grown, scale_));
  growth_tracker_.masked_fill_(grow, 0);
  hysteresis_tracker_.masked_fill_(grow, options_.hysteresis);
}

void LossScaler::set_dynamic_scaling(const DynamicScaling& scaling) {
  TORCH_CHECK(dynamic_, "amp: loss scaler ", loss_id_, " uses a static scale, which never changes; "
              "its dynamic knobs would do nothing. Initialize with "
              "amp::LossScale::Dynamic() to tune them.");
  internal::check_dynamic_scaling(scaling);
  options_ = scaling;
  hysteresis_tracker_.clamp_max_(scaling.hysteresis);
}

void LossScaler::set_growth_factor(double factor) {
  DynamicScaling changed = options_;
  changed.growth_factor = factor;
  set_dynamic_scaling(changed);
}

void LossScaler::set_backoff_factor(double factor) {
  DynamicScaling changed = options_;
  changed.backoff_factor = factor;
  set_dynamic_scaling(changed);
}

void LossScaler::set_growth_interval(int64_t steps) {
  DynamicScaling changed = options_;
  changed.growth_interval = steps;
  set_dynamic_scaling(changed);
}

namespace {

// The dynamic knobs as archive entries: (name, value as double).
constexpr const char* kKnobs[] = {"growth_factor", "backoff_factor", "growth_interval",
                                  "hysteresis", "max_loss_scale", "min_loss_scale", "at_floor"};

std::vector<double> knob_values(const DynamicScaling& d) {
  return {d.growth_factor, d.backoff_factor, static_cast<double>(d.growth_interval),
          static_cast<double>(d.hysteresis), d.max_loss_scale,
          d.min_loss_scale.value_or(std::nan("")), static_cast<double>(d.at_floor)};
}

DynamicScaling knobs_from(const std::vector<double>& v) {
  DynamicScaling d;
  d.growth_factor = v[0];
  d.backoff_factor = v[1];
  d.growth_interval = static_cast<int64_t>(v[2]);
  d.hysteresis = static_cast<int64_t>(v[3]);
  d.max_loss_scale = v[4];
  if (!std::isnan(v[5])) d.min_loss_scale = v[5];
  d.at_floor = v[6] == 0 ? DynamicScaling::AtFloor::kHold : DynamicScaling::AtFloor::kRaise;
  return d;
}

}  // namespace

void LossScaler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("scale", scale_.cpu());
  archive.write("growth_tracker", growth_tracker_.cpu());
  archive.write("hysteresis_tracker", hysteresis_tracker_.cpu());
  archive.write("dynamic", at::scalar_tensor(dynamic_ ? 1 : 0, at::kInt));
  const std::vector<double> values = knob_values(options_);
  for (size_t i = 0; i < values.size(); ++i) {
    archive.write(kKnobs[i], at::scalar_tensor(values[i], at::kDouble));
  }
}

void LossScaler::load(torch::serialize::InputArchive& archive) {
  auto read = [&](const char* key, at::ScalarType dtype) {
    at::Tensor t;
    TORCH_CHECK(archive.try_read(key, t), "amp: loss scaler ", loss_id_,
                " state has no entry '", key, "'; was it saved by amp::save_state?");
    TORCH_CHECK(t.scalar_type() == dtype && t.numel() == 1, "amp: loss scaler ", loss_id_,
                " entry '", key, "' should hold one ", dtype, " value, got ", t.scalar_type(),
                " with ", t.numel(), " values");
    return t;
  };
  for (const std::string& key : archive.keys()) {
    const bool knob = std::find_if(std::begin(kKnobs), std::end(kKnobs),
                                   [&](const char* k) { return key == k; }) != std::end(kKnobs);
    TORCH_CHECK(knob || key == "scale" || key == "growth_tracker" || key == "hysteresis_tracker" ||
                    key == "dynamic",
                "amp: unexpected entry '", key, "' in loss scaler ", loss_id_, "'s state.");
  }
  // The knobs: all or none (archives written before they were saved).
  std::optional<DynamicScaling> knobs;
  if (archive.keys().size() > 4) {
    std::vector<double> values;
    for (const char* key : kKnobs) values.push_back(read(key, at::kDouble).item<double>());
    const double at_floor = values.back();
    TORCH_CHECK(at_floor == 0 || at_floor == 1, "amp: loss scaler ", loss_id_, " entry 'at_floor' "
                "holds ", at_floor, "; expected 0 (hold) or 1 (raise). The checkpoint is corrupt.");
    for (double v : {values[2], values[3]}) {
      TORCH_CHECK(v == std::floor(v) && std::abs(v) < 1e15, "amp: loss scaler ", loss_id_,
                  " holds a step count of ", v, "; expected a whole number. The checkpoint is corrupt.");
    }
    knobs = knobs_from(values);
    try {
      internal::check_dynamic_scaling(*knobs);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "amp: loss scaler ", loss_id_, " was saved with knobs out of range (",
                  e.msg(), "). The checkpoint is corrupt.");
    }
  }
  const at::Tensor scale = read("scale", at::kFloat);
  const at::Tensor growth = read("growth_tracker", at::kInt);
  const at::Tensor hysteresis = read("hysteresis_tracker", at::kInt);
  const at::Tensor dynamic = read("dynamic", at::kInt);
  TORCH_CHECK((dynamic.item<int>() != 0) == dynamic_, "amp: loss scaler ", loss_id_,
              " was saved with ", dynamic.item<int>() ? "dynamic" : "static",
              " loss scaling, but this run uses ", dynamic_ ? "dynamic" : "static",
              " scaling; initialize with the same opt_level and loss_scale as the checkpoint.");
  const float value = scale.item<float>();
  TORCH_CHECK(std::isfinite(value) && value > 0, "amp: loss scaler ", loss_id_, " was saved with "
              "scale ", value, "; a loss scale must be finite and positive. The checkpoint is corrupt.");
  TORCH_CHECK(growth.item<int>() >= 0, "amp: loss scaler ", loss_id_, " was saved with growth "
              "tracker ", growth.item<int>(), "; it counts clean steps and cannot be negative. The "
              "checkpoint is corrupt.");
  const c10::Device device = scale_.device();
  if (knobs) options_ = *knobs;
  scale_ = scale.reshape({1}).to(device);
  growth_tracker_ = growth.reshape({1}).to(device);
  hysteresis_tracker_ = hysteresis.reshape({1}).to(device);
}

}  // namespace amp
