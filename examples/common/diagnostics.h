// SPDX-License-Identifier: BSD-3-Clause
// What the examples show of amp's overflow diagnostics: --inject_non_finite,
// which makes one named module's weights non-finite for one step, and
// printing amp's overflow report (overflow.h) and precision telemetry
// (telemetry.h).
#pragma once

#include <amp/diagnostics.h>

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

namespace examples {

// --inject_non_finite="<module>:<step>", e.g. "fc1:100": at that step (from
// 1) the first element of the module's first parameter becomes inf for one
// iteration. Empty: no injection.
class NonFiniteInjection {
 public:
  // Throws std::invalid_argument naming the flag when `flag` is malformed
  // or `model` has no such module (the message lists the names it has).
  NonFiniteInjection(const std::string& flag, const torch::nn::Module& model);

  bool enabled() const { return !module_.empty(); }
  bool at(int64_t step) const { return enabled() && step == step_; }
  // Injects at `step` (or does nothing); the value comes back when the
  // returned object is destroyed - after the iteration's optimizer step.
  std::shared_ptr<void> inject(int64_t step, torch::nn::Module& model) const;

 private:
  std::string module_;
  int64_t step_ = 0;
};

void print_overflow(std::ostream& out, const amp::OverflowReport& report);
// After the injected step: the report of the overflow it caused, or why
// there is none (a static scale never skips).
void print_injection_outcome(std::ostream& out, torch::optim::Optimizer& optimizer);
// --measured_policy: how many GEMM/convolution shapes run in float32, and
// the policy's table (amp/measured_policy.h).
void print_measured_policy(std::ostream& out);
// Per parameter: elements, underflow, zeros, amax; with group totals.
void print_telemetry(std::ostream& out, const amp::PrecisionTelemetry& telemetry);
// With the fp8 property: per layer and operand, the format, scale, amax and
// the fractions saturated and flushed to zero (amp::fp8_telemetry).
void print_fp8_telemetry(std::ostream& out, const std::vector<amp::Fp8TensorTelemetry>& tensors);
// With the fp8 property: per linear layer, float8 or bfloat16 and why
// (amp::fp8_choices).
void print_fp8_choices(std::ostream& out, const std::vector<amp::Fp8LayerChoice>& layers);

}  // namespace examples
