// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// amp's optimization levels O0-O6, as data, and the validation of overrides.
///
/// An opt level is a named set of properties (Apex's table). A user picks a level
/// and may override single properties; resolve_properties() applies the
/// overrides and rejects every combination that makes no sense, with an error
/// that says what to do instead.
///
/// ```
///   level  cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale  stochastic_rounding
///   O0     float32          false                  -                    false           1.0         false
///   O1     -                true                   -                    -               dynamic     false
///   O2     low precision    false                  true                 true            dynamic     false
///   O3     low precision    false                  false                false           1.0         false
///   O4     -                true (bf16)            -                    -               1.0         false
///   O5     bfloat16         false                  true                 true            1.0         false
///   O6     bfloat16         false                  true                 false           1.0         true
/// ```
///
/// "low precision" is the model device's dtype: float16 on CUDA, bfloat16 on
/// CPU, unless PropertyOverrides::cpu_dtype / cuda_dtype choose otherwise. O4
/// and O5 are the bf16 levels of Apex-ROCm (O1 and O2 in bfloat16; bf16's fp32
/// exponent range needs no loss scaling). O6 trains bf16 weights without
/// float32 masters: amp's fused optimizers compute each update in float32
/// and round it into the weight stochastically (unbiased, so updates smaller
/// than half a bf16 ulp still move the weight on average), keeping their
/// state in optimizer_state_dtype - 8 bytes per parameter with Adam's state
/// in bf16, against 16 for float32 training; 6 with 8-bit state (uint8, at
/// any level but O3).
///
/// Example:
/// ```
///   amp::PropertyOverrides overrides;
///   overrides.keep_batchnorm_fp32 = false;
///   amp::Options options = amp::O2;
///   options.keep_batchnorm_fp32 = false;       // PropertyOverrides are Options' base
///   amp::initialize(model, optimizer, options);
///   std::cout << amp::describe(amp::properties());
/// ```
///
/// Errors (c10::Error, thrown by amp::initialize and parse_opt_level):
///   - an unknown level name ("o1", "0O", "O9"): lists the valid names and notes
///     that the O is the letter O;
///   - cast_model_type other than float32 under O1/O4 (use O2 or O3 to cast the
///     model);
///   - patch_torch_functions=true outside O1/O4 (choose O1);
///   - keep_batchnorm_fp32 or master_weights set at all under O1/O4 (O1 keeps
///     the model fp32, so neither applies);
///   - a dtype other than float16/bfloat16, or float16 under O4/O5/O6;
///   - stochastic_rounding=true with master_weights, or with a model cast to
///     anything but bfloat16 (it rounds updates into bf16 weights: use O6);
///   - optimizer_state_dtype other than float32/bfloat16/uint8; float32 or
///     bfloat16 set without stochastic_rounding (other levels keep the state
///     in the weights' dtype); uint8 where the optimizer steps a
///     low-precision model without masters or rounding (O3);
///   - fp8=true at any level but O5 (or with O5's masters or bfloat16 model
///     overridden);
///   - step_in_backward=true with a dynamic loss scale (it could skip the
///     step after backward) or with master weights (O2, O5);
///   - scaler values out of range: a loss scale <= 0
///     or not finite, growth_factor <= 1, backoff_factor outside (0, 1),
///     growth_interval or hysteresis < 1 or above 2^31-1 (int32 counters),
///     min_loss_scale > max_loss_scale.
///
/// Layers: Options (options.h) is what users set - a level, these overrides
/// and amp's own knobs; Properties is the resolved level amp reads; each
/// LossScaler (loss_scaler.h) starts from Properties::dynamic_scaling and may
/// be re-tuned while training.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace amp {

/// amp's optimization levels (the table above); amp::O0 .. amp::O6 name them.
enum class OptLevel : uint8_t { O0, O1, O2, O3, O4, O5, O6 };

inline constexpr OptLevel O0 = OptLevel::O0;  ///< FP32 baseline; scale_loss still works.
inline constexpr OptLevel O1 = OptLevel::O1;  ///< per-op casts, fp32 weights.
inline constexpr OptLevel O2 = OptLevel::O2;  ///< low-precision model, fp32 BN and masters.
inline constexpr OptLevel O3 = OptLevel::O3;  ///< everything low precision.
inline constexpr OptLevel O4 = OptLevel::O4;  ///< O1 in bfloat16.
inline constexpr OptLevel O5 = OptLevel::O5;  ///< O2 in bfloat16.
inline constexpr OptLevel O6 = OptLevel::O6;  ///< bfloat16 weights, no masters, stochastic rounding.

/// "O0".."O6". Anything else is an error listing the valid names.
OptLevel parse_opt_level(std::string_view name);
/// The level's name, "O0".."O6".
const char* to_string(OptLevel level);


/// What the optimizer steps and how gradients are scaled.
struct LossScale {
  bool dynamic = true;  ///< dynamic scaling (DynamicScaling's knobs), or a fixed scale
  double value = 65536.0;  ///< static: the fixed scale; dynamic: the initial scale.

  static LossScale Dynamic(double init_scale = 65536.0) { return {true, init_scale}; }  ///< a dynamic scale starting at `init_scale`
  static LossScale Static(double scale) { return {false, scale}; }  ///< the fixed scale `scale`
};

/// Knobs of dynamic loss scaling (Apex, GradScaler, DeepSpeed, Megatron).
struct DynamicScaling {
  /// What a dynamic scaler does when gradients overflow with the scale
  /// already at min_loss_scale: keep skipping steps at the floor, or throw.
  enum class AtFloor : uint8_t { kHold, kRaise };

  double growth_factor = 2.0;     ///< scale *= growth_factor after growth_interval clean steps
  double backoff_factor = 0.5;    ///< scale *= backoff_factor on overflow
  int64_t growth_interval = 2000;  ///< clean steps after which the scale grows
  /// Without a floor the scale still never drops below the smallest normal
  /// float (2**-126), so it cannot collapse to a denormal or zero.
  std::optional<double> min_loss_scale;
  double max_loss_scale = 16777216.0;  ///< 2**24, Apex's default ceiling
  /// Overflows tolerated before the scale backs off (the step is skipped either
  /// way); reset when the scale grows (Megatron's DynamicGradScaler).
  int64_t hysteresis = 1;
  AtFloor at_floor = AtFloor::kHold;  ///< what an overflow at min_loss_scale does
};

/// Overrides of a level's properties: anything set replaces the level's value.
struct PropertyOverrides {
  std::optional<c10::ScalarType> cast_model_type;  ///< the dtype the model is converted to (float32: checked)
  std::optional<bool> patch_torch_functions;  ///< amp casts per op (O1, O4)
  std::optional<bool> keep_batchnorm_fp32;  ///< affine BatchNorm stays float32 in a converted model
  std::optional<bool> master_weights;  ///< the optimizer steps float32 master weights (O2, O5)
  std::optional<LossScale> loss_scale;  ///< a static or dynamic loss scale
  /// Dtype of ops that Apex computes on the model's outputs (losses, softmax,
  /// norms: amp's fp32 list) at O2/O3. float32 (default) or the low dtype.
  std::optional<c10::ScalarType> cast_model_outputs;
  /// Low-precision dtype per device: float16 or bfloat16. Defaults: CUDA
  /// float16, CPU bfloat16 (LibTorch's native autocast defaults).
  ///@{
  std::optional<c10::ScalarType> cpu_dtype;
  std::optional<c10::ScalarType> cuda_dtype;
  ///@}
  DynamicScaling dynamic_scaling;  ///< the knobs of dynamic loss scaling
  /// Without master weights, amp's fused optimizers round each update into
  /// the bf16 weights stochastically instead of to nearest (O6).
  std::optional<bool> stochastic_rounding;
  /// The dtype of amp's fused optimizers' state (Adam's moments, SGD's
  /// momentum). With stochastic_rounding: float32 or bfloat16 (O6's
  /// default, rounded stochastically too). At any level whose optimizer
  /// steps float32 values or O6's weights (all but O3): uint8
  /// (torch::kUInt8), 8-bit blockwise state as bitsandbytes' and torchao's
  /// 8-bit optimizers keep it - 256 values a block scaled by their maximum,
  /// logarithmic codes, rounded stochastically: 2 bytes a parameter for
  /// Adam's two moments, where float32 takes 8.
  std::optional<c10::ScalarType> optimizer_state_dtype;
  /// On top of O5: linear layers' GEMMs (forward and both gradients) in
  /// float8 with per-tensor scales (Options::fp8_scaling), through
  /// at::_scaled_mm; everything else as O5 (bfloat16, float32 masters).
  std::optional<bool> fp8;
  /// Each parameter's update applied during backward, as soon as its
  /// gradient is final, and the gradient freed then: a step never holds all
  /// gradients (torchtune's optimizer-in-backward, LOMO). Needs what no step
  /// after backward can skip or change: a static loss scale (the bfloat16
  /// levels' 1, O4 and O6, or LossScale::Static: as always with a static
  /// scale, inf/NaN gradients are applied, not skipped), no master weights,
  /// amp's fused optimizers, and no gradient clipping (docs/guide.md, "The
  /// step inside backward"). Data parallel: sharded only (ZeRO-2, ZeRO-3),
  /// where each rank steps its pieces as soon as their bucket's reduction is
  /// averaged, during backward.
  std::optional<bool> step_in_backward;
};

/// A level with its overrides applied and validated.
struct Properties {
  OptLevel opt_level = OptLevel::O1;  ///< the level the properties start from
  /// nullopt: the model is not touched (O1). kFloat: checked to be fp32 (O0).
  /// kHalf / kBFloat16: converted (O2/O3: the model device's low dtype).
  std::optional<c10::ScalarType> cast_model_type;
  bool patch_torch_functions = false;  ///< amp casts per op (O1, O4)
  bool keep_batchnorm_fp32 = false;  ///< affine BatchNorm stays float32 in a converted model
  bool master_weights = false;  ///< the optimizer steps float32 master weights (O2, O5)
  LossScale loss_scale;  ///< the loss scale: static or dynamic, and its (initial) value
  c10::ScalarType cast_model_outputs = c10::kFloat;  ///< as PropertyOverrides::cast_model_outputs
  c10::ScalarType cpu_dtype = c10::kBFloat16;  ///< the low-precision dtype on the CPU
  c10::ScalarType cuda_dtype = c10::kHalf;  ///< the low-precision dtype on CUDA
  DynamicScaling dynamic_scaling;  ///< the knobs each dynamic LossScaler starts from
  bool stochastic_rounding = false;  ///< fused optimizers round updates into bf16 weights stochastically (O6)
  c10::ScalarType optimizer_state_dtype = c10::kFloat;  ///< read with stochastic_rounding, and uint8 anywhere
  bool fp8 = false;  ///< linear GEMMs in float8 (O5's model and masters)
  bool step_in_backward = false;  ///< each update applied during backward

  /// False when Options::enabled is false: the loop runs as plain float32
  /// (O0's properties: no casts, no loss scaling, no skipped steps).
  bool enabled = true;

  /// The low-precision dtype used for tensors on `device`.
  c10::ScalarType low_precision_dtype(c10::DeviceType device) const;
  /// O2/O3/O5: a lower-precision op runs in the dtype of its weights, so fp32
  /// inputs meet a low-precision model and modules kept fp32 compute in fp32.
  /// O1/O4 cast fp32 weights per op instead.
  bool weights_decide_op_dtype() const { return !patch_torch_functions; }
  /// Whether the fp32-family policies apply; not when cast_model_outputs asks
  /// O2/O3 to keep the ops on the model's outputs in its low dtype.
  bool runs_fp32_policies() const {
    return patch_torch_functions || cast_model_outputs == c10::kFloat;
  }
  /// True when amp intercepts ops in the dispatcher: O1/O4 cast fp32 weights
  /// per op; O2/O3/O5 cast activations to meet a low-precision model (C++
  /// cannot patch forward, so the dispatcher does what Apex's forward patch did).
  bool intercepts_ops() const;
};

/// A short multi-line table of the resolved properties (printed at verbosity 1).
std::string describe(const Properties& properties);

}  // namespace amp
