// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Precision telemetry: how much of each gradient the low-precision dtype
/// loses at the loss scale it ran with, the gradients' largest magnitudes,
/// and the history of the loss scale. Recorded on the device by every
/// scale_loss guard; read only when asked.
///
/// ```
///   options.precision_telemetry = true;
///   amp::initialize(model, optimizer, options);
///   ... train ...
///   const auto t = amp::precision_telemetry(optimizer);  // the latest guard over it
///   for (const auto& group : t->groups) {
///     std::cout << group.underflow_fraction() << " " << group.amax << "\n";
///     for (const auto& p : group.parameters) std::cout << p.name << " " << p.underflow << "\n";
///   }
///   const std::vector<double> scales = amp::scale_history();  // loss 0
/// ```
///
/// Underflow counts the gradient elements a guard unscaled that are nonzero
/// but that, multiplied by the loss scale the backward ran with, round to
/// zero in the low-precision dtype of their device (float16: |g * scale| <=
/// 2^-25; bfloat16: <= 2^-134): what the scale fails to lift above the low
/// dtype's floor. Gradients that backward computed in the low dtype hold,
/// scaled, only values it can represent: their elements that flushed inside
/// backward are zeros here, counted in `zeros`, not in `underflow`. So
/// `underflow` measures gradients computed in float32 (fp32-policy ops,
/// float32 parameters), and a `zeros` fraction that grows as the scale drops
/// shows flushing in the low dtype. A guard with
/// delay_unscale=true records nothing (its gradients are still scaled); the
/// guard that unscales records the accumulated ones.
///
/// Cost: with it on, each guard runs a few kernels per parameter group and
/// device (a copy of the gradients into one buffer, its cast and a cumulative
/// count) and keeps the scale it ran with; healthy steps add no host sync.
/// Reading makes one copy to the host per call.
///
/// With the fp8 property (opt_levels.h) it also tallies every float8
/// operand - each linear layer's input, weight and incoming gradient - over
/// an iteration: how many elements the scale pushed past the format's
/// largest value (saturated: clamped to it) and how many nonzero ones
/// rounded to zero (flushed). fp8_telemetry() returns each operand's latest
/// iteration a guard ended:
///
/// ```
///   for (const auto& t : amp::fp8_telemetry())
///     std::cout << t.layer << " " << t.operand << " " << t.saturated_fraction() << "\n";
/// ```
///
/// That costs a few more kernels per quantization, on the device.
///
/// Errors (c10::Error): amp is not initialized; Options::precision_telemetry
/// is off (set it to true); an optimizer that was not passed to the live
/// amp::initialize; a loss_id outside 0..num_losses-1; fp8_telemetry()
/// without the fp8 property (set PropertyOverrides::fp8 at O5).
#pragma once

#include <amp/internal/refs.h>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace amp {

/// One parameter's gradient as the latest guard unscaled it.
struct ParameterTelemetry {
  /// As named_parameters names it ("fc1.weight"; "model1.fc1.weight" with
  /// several models).
  std::string name;
  int64_t numel = 0;      ///< the gradient's elements
  int64_t underflow = 0;  ///< nonzero elements that round to zero at the scale
  int64_t zeros = 0;      ///< elements that are zero (some may have flushed in backward)
  double amax = 0;        ///< the largest |g| (inf/NaN when the step overflowed)
};

/// One parameter group of the optimizer: its parameters, and their sums.
struct GroupTelemetry {
  std::vector<ParameterTelemetry> parameters;  ///< those with a gradient, in group order
  int64_t numel = 0;      ///< the parameters' numel, summed
  int64_t underflow = 0;  ///< their underflow, summed
  int64_t zeros = 0;      ///< their zeros, summed
  double amax = 0;        ///< the largest of their amax (NaN when one is NaN)
  /// underflow / numel (0 without elements).
  double underflow_fraction() const { return numel > 0 ? static_cast<double>(underflow) / numel : 0.0; }
  /// zeros / numel (0 without elements).
  double zero_fraction() const { return numel > 0 ? static_cast<double>(zeros) / numel : 0.0; }
};

/// What one guard over an optimizer recorded.
struct PrecisionTelemetry {
  int loss_id = 0;  ///< the guard's loss
  double loss_scale = 0;  ///< the scale the recorded backward ran with
  std::vector<GroupTelemetry> groups;  ///< one per param group of the optimizer
};

/// One float8 operand of one linear layer over its latest iteration.
struct Fp8TensorTelemetry {
  std::string layer;    ///< the layer's weight, by name ("fc1.weight")
  std::string operand;  ///< "input", "weight" or "grad_output"
  c10::ScalarType format = c10::kFloat8_e4m3fn;  ///< the float8 format it was quantized to
  int64_t calls = 0;      ///< quantizations (a weight: once an iteration, then reused)
  int64_t numel = 0;      ///< elements quantized over the calls
  double amax = 0;        ///< the largest |x| (inf/NaN when one held it)
  double scale = 0;       ///< the scale of the latest call
  int64_t saturated = 0;  ///< elements with |x * scale| above the format's largest value
  int64_t flushed = 0;    ///< nonzero elements that rounded to zero
  /// saturated / numel (0 without elements).
  double saturated_fraction() const { return numel > 0 ? static_cast<double>(saturated) / numel : 0.0; }
  /// flushed / numel (0 without elements).
  double flushed_fraction() const { return numel > 0 ? static_cast<double>(flushed) / numel : 0.0; }
};

/// The fp8 property's choice for one linear layer at its latest call: float8,
/// or bfloat16 and why (Options::Fp8Scaling::min_gemm_intensity, or shapes
/// the device's float8 kernel cannot take).
struct Fp8LayerChoice {
  std::string layer;  ///< the layer's weight, by name ("fc1.weight")
  bool float8 = false;  ///< whether its latest call ran in float8
  ///@{
  int64_t rows = 0, in = 0, out = 0;  ///< the GEMM: [rows, in] x [in, out]
  ///@}
  double intensity = 0;  ///< rows*in*out / (rows*in + in*out + rows*out)
  std::string reason;    ///< "intensity 692 < 3000 (min_gemm_intensity)"
};

/// What the latest guard over `optimizer` recorded; nullopt before the first.
std::optional<PrecisionTelemetry> precision_telemetry(internal::OptimizerRef optimizer);

/// The scale each guard of loss `loss_id` ran its backward with, oldest
/// first (at most the latest 10000).
std::vector<double> scale_history(int loss_id = 0);

/// Every float8 operand's latest iteration, by layer name and operand;
/// empty before the first guard that ended an iteration.
std::vector<Fp8TensorTelemetry> fp8_telemetry();

/// Every linear layer the fp8 property saw, by name: whether its latest call
/// ran in float8, and why. Needs the fp8 property (else an error), not
/// precision_telemetry.
std::vector<Fp8LayerChoice> fp8_choices();

/// Which code quantizes float8 operands on `device`, in words: amp's fused
/// CUDA kernels (where this build has them for the device's architecture:
/// AMP_CUDA_ARCHITECTURES), or ATen ops and why; on a CPU, that float8 GEMMs
/// are emulated (float32 GEMMs of the float8 values: float8's rounding, not
/// its speed). Needs no live amp; the precision report prints it.
std::string fp8_quantization_path(c10::Device device);

}  // namespace amp
