// Precision telemetry: how much of each gradient the low-precision dtype
// loses at the loss scale it ran with, the gradients' largest magnitudes,
// and the history of the loss scale. Recorded on the device by every
// scale_loss guard; read only when asked.
//
//   options.precision_telemetry = true;
//   amp::initialize(model, optimizer, options);
//   ... train ...
//   const auto t = amp::precision_telemetry(optimizer);  // the latest guard over it
//   for (const auto& group : t->groups) {
//     std::cout << group.underflow_fraction() << " " << group.amax << "\n";
//     for (const auto& p : group.parameters) std::cout << p.name << " " << p.underflow << "\n";
//   }
//   const std::vector<double> scales = amp::scale_history();  // loss 0
//
// Underflow counts the gradient elements a guard unscaled that are nonzero
// but that, multiplied by the loss scale the backward ran with, round to
// zero in the low-precision dtype of their device (float16: |g * scale| <=
// 2^-25; bfloat16: <= 2^-134): what the scale fails to lift above the low
// dtype's floor. Gradients that backward computed in the low dtype hold,
// scaled, only values it can represent: their elements that flushed inside
// backward are zeros here, counted in `zeros`, not in `underflow`. So
// `underflow` measures gradients computed in float32 (fp32-policy ops,
// float32 parameters), and a `zeros` fraction that grows as the scale drops
// shows flushing in the low dtype. A guard with
// delay_unscale=true records nothing (its gradients are still scaled); the
// guard that unscales records the accumulated ones.
//
// Cost: with it on, each guard runs a few kernels per parameter group and
// device (a copy of the gradients into one buffer, its cast and a cumulative
// count) and keeps the scale it ran with; healthy steps add no host sync.
// Reading makes one copy to the host per call.
//
// Errors (c10::Error): amp is not initialized; Options::precision_telemetry
// is off (set it to true); an optimizer that was not passed to the live
// amp::initialize; a loss_id outside 0..num_losses-1.
#pragma once

#include <amp/internal/refs.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace amp {

struct ParameterTelemetry {
  // As named_parameters names it ("fc1.weight"; "model1.fc1.weight" with
  // several models).
  std::string name;
  int64_t numel = 0;
  int64_t underflow = 0;  // nonzero elements that round to zero at the scale
  int64_t zeros = 0;      // elements that are zero (some may have flushed in backward)
  double amax = 0;        // the largest |g| (inf/NaN when the step overflowed)
};

struct GroupTelemetry {
  std::vector<ParameterTelemetry> parameters;  // those with a gradient, in group order
  int64_t numel = 0;
  int64_t underflow = 0;
  int64_t zeros = 0;
  double amax = 0;
  double underflow_fraction() const { return numel > 0 ? static_cast<double>(underflow) / numel : 0.0; }
  double zero_fraction() const { return numel > 0 ? static_cast<double>(zeros) / numel : 0.0; }
};

struct PrecisionTelemetry {
  int loss_id = 0;
  double loss_scale = 0;  // the scale the recorded backward ran with
  std::vector<GroupTelemetry> groups;  // one per param group of the optimizer
};

// What the latest guard over `optimizer` recorded; nullopt before the first.
std::optional<PrecisionTelemetry> precision_telemetry(internal::OptimizerRef optimizer);

// The scale each guard of loss `loss_id` ran its backward with, oldest
// first (at most the latest 10000).
std::vector<double> scale_history(int loss_id = 0);

}  // namespace amp
