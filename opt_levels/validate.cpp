// SPDX-License-Identifier: BSD-3-Clause
// resolve_properties: a level's defaults plus the user's overrides, validated
// the way Apex's Properties setters validate them, plus range checks on the
// loss-scaling knobs.
#include "levels.h"
#include <amp/internal/level_rules.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace amp {
namespace {

void check_dtype(const char* name, const std::optional<c10::ScalarType>& dtype,
                 const LevelDefaults& level) {
  if (!dtype) return;
  TORCH_CHECK(internal::is_low_precision(*dtype), "amp: ", name,
              " must be float16 (c10::kHalf) or bfloat16 (c10::kBFloat16), got ", *dtype);
  TORCH_CHECK(!level.bfloat16_only || *dtype == c10::kBFloat16, "amp: ", level.name,
              " is a bfloat16 level, so ", name, " cannot be ", *dtype, "; use ",
              level.float16_level ? to_string(*level.float16_level) : "another level", " for float16.");
}

void check_positive_finite(const char* name, double value) {
  TORCH_CHECK(std::isfinite(value) && value > 0, "amp: ", name,
              " must be a finite number > 0, got ", value);
}

}  // namespace

void internal::check_dynamic_scaling(const DynamicScaling& d) {
  TORCH_CHECK(std::isfinite(d.growth_factor) && d.growth_factor > 1,
              "amp: growth_factor must be > 1 so the scale can grow, got ", d.growth_factor);
  TORCH_CHECK(d.backoff_factor > 0 && d.backoff_factor < 1,
              "amp: backoff_factor must lie in (0, 1) so the scale shrinks on overflow, got ",
              d.backoff_factor);
  // The trackers count in int32 tensors on the device, as GradScaler's.
  constexpr int64_t kMostSteps = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(d.growth_interval >= 1 && d.growth_interval <= kMostSteps, "amp: growth_interval must "
              "be >= 1 step and fit an int32 step counter (<= ", kMostSteps, "), got ", d.growth_interval);
  TORCH_CHECK(d.hysteresis >= 1 && d.hysteresis <= kMostSteps, "amp: hysteresis must be >= 1 (1 "
              "backs off on every overflow) and fit an int32 counter (<= ", kMostSteps, "), got ",
              d.hysteresis);
  check_positive_finite("max_loss_scale", d.max_loss_scale);
  if (d.min_loss_scale) {
    check_positive_finite("min_loss_scale", *d.min_loss_scale);
    TORCH_CHECK(*d.min_loss_scale <= d.max_loss_scale, "amp: min_loss_scale (",
                *d.min_loss_scale, ") must not exceed max_loss_scale (", d.max_loss_scale, ")");
  }
}

Properties internal::resolve_properties(OptLevel level, const PropertyOverrides& o,
                              c10::DeviceType model_device) {
  const LevelDefaults& defaults = level_defaults(level);
  const char* name = defaults.name;
  check_dtype("cpu_dtype", o.cpu_dtype, defaults);
  check_dtype("cuda_dtype", o.cuda_dtype, defaults);
  internal::check_dynamic_scaling(o.dynamic_scaling);

  Properties p;
  p.opt_level = level;
  p.cpu_dtype = defaults.bfloat16_only ? c10::kBFloat16 : o.cpu_dtype.value_or(c10::kBFloat16);
  p.cuda_dtype = defaults.bfloat16_only ? c10::kBFloat16 : o.cuda_dtype.value_or(c10::kHalf);
  p.dynamic_scaling = o.dynamic_scaling;

  switch (defaults.model_cast) {
    case ModelCast::kNone: break;
    case ModelCast::kFloat32: p.cast_model_type = c10::kFloat; break;
    case ModelCast::kLowPrecision: p.cast_model_type = p.low_precision_dtype(model_device); break;
  }
  if (o.cast_model_type) {
    const c10::ScalarType t = *o.cast_model_type;
    TORCH_CHECK(t == c10::kFloat || internal::is_low_precision(t),
                "amp: cast_model_type must be float32, float16 or bfloat16, got ", t);
    TORCH_CHECK(!defaults.casts_per_op() || t == c10::kFloat, "amp: ", name,
                " inserts casts around LibTorch ops rather than casting model weights, so "
                "the model weights themselves should remain float32. To cast the model to ",
                t, ", use opt_level O2 or O3. cast_model_type was ", t);
    p.cast_model_type = t;
  }

  p.patch_torch_functions = defaults.patch_torch_functions;
  if (o.patch_torch_functions) {
    TORCH_CHECK(!*o.patch_torch_functions || defaults.casts_per_op(), "amp: patch_torch_functions=true "
                "(per-op casting of fp32 weights) is what O1 does; select opt_level O1 instead "
                "of ", name, " with this override.");
    p.patch_torch_functions = *o.patch_torch_functions;
  }

  TORCH_CHECK(!o.keep_batchnorm_fp32 || !defaults.casts_per_op(), "amp: with opt_level ", name,
              " the model stays float32 and batchnorm ops run in the dtype of their input, so "
              "keep_batchnorm_fp32 must be left unset. keep_batchnorm_fp32 was ",
              o.keep_batchnorm_fp32.value_or(false) ? "true" : "false");
  p.keep_batchnorm_fp32 = o.keep_batchnorm_fp32.value_or(defaults.keep_batchnorm_fp32.value_or(false));

  TORCH_CHECK(!o.master_weights || !defaults.casts_per_op(), "amp: master_weights make no sense "
              "with opt_level ", name, ": the model weights themselves stay float32. Leave "
              "master_weights unset, or use O2.");
  p.master_weights = o.master_weights.value_or(defaults.master_weights.value_or(false));

  p.loss_scale = defaults.static_loss_scale ? LossScale::Static(*defaults.static_loss_scale)
                                            : LossScale::Dynamic();
  if (o.loss_scale) {
    check_positive_finite(o.loss_scale->dynamic ? "the initial dynamic loss scale"
                                                : "a static loss scale",
                          o.loss_scale->value);
    p.loss_scale = *o.loss_scale;
  }
  if (p.loss_scale.dynamic) {  // Apex clamps the initial scale into [min, max].
    p.loss_scale.value = std::min(p.loss_scale.value, p.dynamic_scaling.max_loss_scale);
    p.loss_scale.value = std::max(p.loss_scale.value,
                                  p.dynamic_scaling.min_loss_scale.value_or(0.0));
  }

  if (o.cast_model_outputs) {
    const c10::ScalarType t = *o.cast_model_outputs;
    const bool casts_model = p.cast_model_type && *p.cast_model_type != c10::kFloat;
    TORCH_CHECK(casts_model, "amp: cast_model_outputs applies to levels that cast the model "
                "(O2, O3, O5); under ", name, " the dtype of ops on the model's outputs follows "
                "the op's cast policy. Remove the override.");
    TORCH_CHECK(t == c10::kFloat || t == *p.cast_model_type, "amp: cast_model_outputs must be "
                "float32 or the model's dtype ", *p.cast_model_type, ", got ", t);
    p.cast_model_outputs = t;
  }

  p.stochastic_rounding = o.stochastic_rounding.value_or(defaults.stochastic_rounding);
  if (p.stochastic_rounding) {
    TORCH_CHECK(!p.master_weights, "amp: stochastic_rounding rounds each update into bfloat16 weights "
                "kept without float32 masters; with master_weights (", name, ") the update lands in "
                "float32. Use opt_level O6, or master_weights=false.");
    TORCH_CHECK(p.cast_model_type == c10::kBFloat16, "amp: stochastic_rounding rounds updates into "
                "bfloat16 weights, but opt_level ", name, " keeps the model in ",
                p.cast_model_type ? c10::toString(*p.cast_model_type) : "float32 (cast per op)",
                ". Use opt_level O6.");
  }
  if (o.optimizer_state_dtype) {
    const c10::ScalarType t = *o.optimizer_state_dtype;
    TORCH_CHECK(t == c10::kFloat || t == c10::kBFloat16 || t == c10::kByte, "amp: optimizer_state_dtype must "
                "be float32 or bfloat16 (O6), or uint8 (8-bit state, torch::kUInt8), got ", t);
    const bool low_model = p.cast_model_type && *p.cast_model_type != c10::kFloat;
    TORCH_CHECK(t != c10::kByte || !low_model || p.master_weights || p.stochastic_rounding, "amp: 8-bit "
                "optimizer state (optimizer_state_dtype uint8) is stepped in float32: float32 parameters (O0, "
                "O1, O4), masters (O2, O5) or O6's rounded bfloat16 weights; under ", name, " the optimizer "
                "steps the model's ", *p.cast_model_type, " weights as they are. Use O2, O5 or O6.");
    TORCH_CHECK(t == c10::kByte || p.stochastic_rounding, "amp: optimizer_state_dtype applies with "
                "stochastic_rounding (O6) where it is float32 or bfloat16 (got ", t, "); under ", name, " the "
                "optimizer keeps its state in the dtype of what it steps, or in 8 bits (uint8). Remove the "
                "override, or use O6.");
  }
  p.optimizer_state_dtype = o.optimizer_state_dtype.value_or(p.stochastic_rounding ? c10::kBFloat16 : c10::kFloat);
  p.fp8 = o.fp8.value_or(false);
  TORCH_CHECK(!p.fp8 || (p.opt_level == OptLevel::O5 && p.master_weights && p.cast_model_type == c10::kBFloat16 &&
                         !p.stochastic_rounding),
              "amp: fp8 runs linear layers' GEMMs in float8 on top of O5 (a bfloat16 model with float32 "
              "masters); under ", name, " it does not apply. Use opt_level O5 with fp8 = true, "
              "without overriding master_weights or cast_model_type.");
  p.step_in_backward = o.step_in_backward.value_or(false);
  TORCH_CHECK(!p.step_in_backward || !p.loss_scale.dynamic, "amp: step_in_backward applies each update during "
              "backward, but ", name, "'s dynamic loss scale may skip the step after backward, when its "
              "overflow check has seen every gradient. Use a bfloat16 level with its static scale (O4, O6), or "
              "a static scale: loss_scale = amp::LossScale::Static(s).");
  TORCH_CHECK(!p.step_in_backward || !p.master_weights, "amp: step_in_backward steps the weights backward writes "
              "gradients to, but ", name, " keeps float32 master weights, which are stepped from gradients "
              "gathered after backward. Use O6 (bfloat16 weights without masters) or O4 (float32 weights).");
  return p;
}

}  // namespace amp
