// SPDX-License-Identifier: BSD-3-Clause
#include "common/diagnostics.h"

#include <amp/diagnostics.h>
#include <amp/measured_policy.h>

#include <amp/optimizer.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/torch.h>

#include <cstdio>
#include <limits>
#include <stdexcept>

namespace examples {
namespace {

std::shared_ptr<torch::nn::Module> find_module(const torch::nn::Module& model, const std::string& name) {
  for (const auto& item : model.named_modules()) {
    if (item.key() == name) return item.value();
  }
  return nullptr;
}

}  // namespace

NonFiniteInjection::NonFiniteInjection(const std::string& flag, const torch::nn::Module& model) {
  if (flag.empty()) return;
  const size_t colon = flag.rfind(':');
  size_t parsed = 0;
  try {
    if (colon == std::string::npos || colon == 0) throw std::invalid_argument("no module");
    step_ = std::stoll(flag.substr(colon + 1), &parsed);
  } catch (const std::exception&) {
    parsed = 0;
  }
  if (parsed == 0 || colon + 1 + parsed != flag.size() || step_ < 1) {
    throw std::invalid_argument("--inject_non_finite: expected '<module>:<step>' with a step from 1, e.g. "
                                "'fc1:100', got '" + flag + "'");
  }
  module_ = flag.substr(0, colon);
  const auto module = find_module(model, module_);
  if (!module || module->parameters(/*recurse=*/false).empty()) {
    std::string names;
    for (const auto& item : model.named_modules()) {
      if (!item.key().empty() && !item.value()->parameters(false).empty()) names += " " + item.key();
    }
    throw std::invalid_argument("--inject_non_finite: the model has no module '" + module_ +
                                "' with parameters; it has:" + names);
  }
}

std::shared_ptr<void> NonFiniteInjection::inject(int64_t step, torch::nn::Module& model) const {
  if (!at(step)) return nullptr;
  torch::NoGradGuard no_grad;  // as programs edit weights
  at::Tensor target = find_module(model, module_)->parameters(false).front().detach().view({-1}).narrow(0, 0, 1);
  at::Tensor saved = target.clone();
  target.fill_(std::numeric_limits<float>::infinity());
  return std::shared_ptr<void>(nullptr, [target, saved](void*) mutable {
    torch::NoGradGuard no_grad;
    target.copy_(saved);
  });
}

void print_overflow(std::ostream& out, const amp::OverflowReport& report) {
  auto where = [&](const amp::NonFiniteOp& op) {
    out << op.op << " (module " << (op.module.empty() ? "?" : op.module) << ", " << c10::toString(op.dtype) << ")";
  };
  out << "Overflow of loss " << report.loss_id << " at loss scale " << report.loss_scale << ":\n";
  out << "  first inf/NaN in forward:  ";
  if (report.forward) {
    where(*report.forward);
    out << (report.forward->input_non_finite ? " - it read an inf/NaN already there (a parameter or the data)"
                                             : " - made from finite inputs");
  } else {
    out << "none";
  }
  out << "\n  first inf/NaN in backward: ";
  if (report.backward) {
    where(*report.backward);
  } else {
    out << "none made from finite gradients";
  }
  out << "\n  non-finite gradients:      ";
  for (size_t i = 0; i < report.non_finite_gradients.size(); ++i) out << (i ? ", " : "") << report.non_finite_gradients[i];
  out << "\n";
}

void print_injection_outcome(std::ostream& out, torch::optim::Optimizer& optimizer) {
  if (!amp::last_step_skipped(optimizer)) {
    out << "The injected step was not skipped: the opt level's loss scale is static or 1, so no overflow check "
           "runs. Use a dynamic scale (O1, O2) to see provenance.\n";
    return;
  }
  if (const auto report = amp::last_overflow(optimizer)) print_overflow(out, *report);
}

void print_telemetry(std::ostream& out, const amp::PrecisionTelemetry& telemetry) {
  char line[256];
  std::snprintf(line, sizeof(line), "Gradient telemetry of loss %d at loss scale %g:\n", telemetry.loss_id,
                telemetry.loss_scale);
  out << line << "| group | parameter | elements | underflow at the scale | zeros | amax |\n"
      << "|---:|---|---:|---:|---:|---:|\n";
  for (const auto g : c10::irange(telemetry.groups.size())) {
    const amp::GroupTelemetry& group = telemetry.groups[g];
    for (const amp::ParameterTelemetry& p : group.parameters) {
      std::snprintf(line, sizeof(line), "| %zu | %s | %lld | %.4f%% | %.2f%% | %.3g |\n", g, p.name.c_str(),
                    static_cast<long long>(p.numel), p.numel ? 100.0 * p.underflow / p.numel : 0.0,
                    p.numel ? 100.0 * p.zeros / p.numel : 0.0, p.amax);
      out << line;
    }
    std::snprintf(line, sizeof(line), "| %zu | (all) | %lld | %.4f%% | %.2f%% | %.3g |\n", g,
                  static_cast<long long>(group.numel), 100 * group.underflow_fraction(), 100 * group.zero_fraction(),
                  group.amax);
    out << line;
  }
}

void print_fp8_telemetry(std::ostream& out, const std::vector<amp::Fp8TensorTelemetry>& tensors) {
  char line[256];
  out << "Float8 operands, latest iteration:\n"
      << "| layer | operand | format | calls | elements | scale | amax | saturated | flushed to zero |\n"
      << "|---|---|---|---:|---:|---:|---:|---:|---:|\n";
  for (const amp::Fp8TensorTelemetry& t : tensors) {
    std::snprintf(line, sizeof(line), "| %s | %s | %s | %lld | %lld | %.4g | %.3g | %.4f%% | %.4f%% |\n",
                  t.layer.c_str(), t.operand.c_str(), c10::toString(t.format), static_cast<long long>(t.calls),
                  static_cast<long long>(t.numel), t.scale, t.amax, 100 * t.saturated_fraction(),
                  100 * t.flushed_fraction());
    out << line;
  }
}

void print_fp8_choices(std::ostream& out, const std::vector<amp::Fp8LayerChoice>& layers) {
  char line[320];
  out << "Linear layers in float8 or bfloat16 (the fp8 property's choice, latest call):\n"
      << "| layer | GEMM rows x in x out | intensity | runs in | why |\n|---|---|---:|---|---|\n";
  for (const amp::Fp8LayerChoice& c : layers) {
    std::snprintf(line, sizeof(line), "| %s | %lld x %lld x %lld | %.0f | %s | %s |\n", c.layer.c_str(),
                  static_cast<long long>(c.rows), static_cast<long long>(c.in), static_cast<long long>(c.out),
                  c.intensity, c.float8 ? "float8" : "bfloat16", c.reason.c_str());
    out << line;
  }
}

void print_measured_policy(std::ostream& out) {
  const std::vector<amp::MeasuredChoice> choices = amp::measured_policy();
  size_t kept = 0;
  for (const auto& c : choices) kept += c.keeps_fp32 ? 1 : 0;
  out << "measured policy: " << kept << " of " << choices.size()
      << " GEMM/convolution shapes run in float32 (measured faster here)\n"
      << amp::format_measured_policy(choices);
}

}  // namespace examples
