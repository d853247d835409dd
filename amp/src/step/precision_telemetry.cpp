// SPDX-License-Identifier: BSD-3-Clause
#include "step/precision_telemetry.h"

#include "step/guard.h"
#include "support/host_read.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>

namespace amp::detail {

namespace {

// After the guard's unscale: the gradients of its optimizers, recorded at
// the scale its backward ran at (accumulating micro-batches are not).
class TelemetryPart final : public GuardPart {
 public:
  explicit TelemetryPart(TelemetryParticipant& recorder) : recorder_(recorder) {}
  void after_unscale(Guard& guard) override {
    if (guard.options().delay_unscale) return;
    std::vector<torch::optim::Optimizer*> optimizers;
    for (OptimizerStep* step : guard.steps()) optimizers.push_back(&step->optimizer());
    const at::Tensor& scale = guard.session().scaler(guard.options().loss_id).scale_tensor(guard.scaled_loss().device());
    recorder_.record(guard.options().loss_id, scale, optimizers);
  }

 private:
  TelemetryParticipant& recorder_;
};

}  // namespace

std::unique_ptr<GuardPart> TelemetryParticipant::open(Guard&) { return std::make_unique<TelemetryPart>(*this); }

TelemetryParticipant::TelemetryParticipant(int num_losses, std::shared_ptr<const ParameterNames> names,
                                     std::function<c10::ScalarType(c10::DeviceType)> low_dtype)
    : names_(std::move(names)), low_dtype_(std::move(low_dtype)), scales_(num_losses) {}

// Per parameter: how many nonzero elements round to zero once multiplied by
// `scale` and held in the device's low dtype, and how many are zero,
// counted from one buffer of all of them (a cumulative count read at each
// parameter's end); and the largest magnitude (one foreach norm).
TelemetryParticipant::Part TelemetryParticipant::record_part(const std::vector<at::Tensor>& params,
                                                       const std::vector<at::Tensor>& grads,
                                                       const at::Tensor& scale) const {
  Part part;
  std::vector<at::Tensor> flat;
  std::vector<int64_t> ends;
  int64_t end = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    part.params.push_back(params[i].unsafeGetTensorImpl());
    part.numel.push_back(grads[i].numel());
    flat.push_back(grads[i].reshape({-1}).to(at::kFloat));
    end += grads[i].numel();
    ends.push_back(end - 1);
  }
  const at::Tensor values = at::cat(flat);
  const c10::ScalarType low = low_dtype_(values.device().type());
  const at::Tensor zero = values.eq(0);
  const at::Tensor lost = (values * scale.to(values.device())).to(low).eq(0).logical_and_(zero.logical_not());
  const at::Tensor at_ends = at::stack({lost, zero}).cumsum(1, at::kLong).index_select(
      1, at::tensor(ends, at::TensorOptions().dtype(at::kLong)).to(values.device()));
  part.counts = at_ends - at::cat({at::zeros({2, 1}, at_ends.options()), at_ends.narrow(1, 0, at_ends.size(1) - 1)}, 1);
  part.amax = at::stack(at::_foreach_norm(flat, INFINITY));
  return part;
}

void TelemetryParticipant::record(int loss_id, const at::Tensor& scale,
                               const std::vector<torch::optim::Optimizer*>& optimizers) {
  at::NoGradGuard no_grad;
  const at::Tensor kept_scale = scale.reshape({}).to(at::kFloat).clone();
  std::lock_guard<std::mutex> lock(mutex_);
  std::deque<at::Tensor>& history = scales_.at(loss_id);
  if (history.size() == kHistory) history.pop_front();
  history.push_back(kept_scale);
  for (torch::optim::Optimizer* optimizer : optimizers) {
    Record record{loss_id, kept_scale, {}};
    for (auto& group : optimizer->param_groups()) {
      // Parts by device, in the group's order within each.
      std::map<std::string, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> by_device;
      for (const at::Tensor& p : group.params()) {
        const at::Tensor& g = p.grad();
        if (!g.defined() || g.numel() == 0) continue;
        auto& [params, grads] = by_device[g.device().str()];
        params.push_back(p);
        grads.push_back(g.is_sparse() ? g.coalesce()._values() : g);
      }
      std::vector<Part> parts;
      for (const auto& [device, entry] : by_device) parts.push_back(record_part(entry.first, entry.second, kept_scale));
      record.groups.push_back(std::move(parts));
    }
    latest_[optimizer] = std::move(record);
  }
}

std::optional<PrecisionTelemetry> TelemetryParticipant::read(const torch::optim::Optimizer& optimizer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = latest_.find(&optimizer);
  if (it == latest_.end()) return std::nullopt;
  const Record& record = it->second;
  std::vector<at::Tensor> recorded{record.scale};
  for (const auto& parts : record.groups) {
    for (const Part& part : parts) {
      recorded.push_back(part.counts);
      recorded.push_back(part.amax);
    }
  }
  const std::vector<double> values = read_to_host(recorded);
  const double* v = values.data();
  PrecisionTelemetry out;
  out.loss_id = record.loss_id;
  out.loss_scale = *v++;
  for (const auto& parts : record.groups) {
    GroupTelemetry group;
    for (const Part& part : parts) {
      const size_t n = part.params.size();
      for (size_t i = 0; i < n; ++i) {
        auto name = names_->find(part.params[i]);
        ParameterTelemetry p{name != names_->end() ? name->second : "(unnamed parameter)", part.numel[i],
                             static_cast<int64_t>(v[i]), static_cast<int64_t>(v[n + i]), v[2 * n + i]};
        group.numel += p.numel;
        group.underflow += p.underflow;
        group.zeros += p.zeros;
        group.amax = std::isnan(p.amax) || std::isnan(group.amax) ? NAN : std::max(group.amax, p.amax);
        group.parameters.push_back(std::move(p));
      }
      v += 3 * n;
    }
    out.groups.push_back(std::move(group));
  }
  return out;
}

std::vector<double> TelemetryParticipant::scale_history(int loss_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::deque<at::Tensor>& history = scales_.at(loss_id);
  return read_to_host(std::vector<at::Tensor>(history.begin(), history.end()));
}

}  // namespace amp::detail

namespace amp {
namespace {

const detail::TelemetryParticipant& recorder_of(const detail::StepSession& session, const char* what) {
  TORCH_CHECK(session.telemetry() != nullptr, "amp: ", what, " needs precision telemetry, which is "
              "off. Set amp::Options::precision_telemetry = true when calling amp::initialize.");
  return *session.telemetry();
}

}  // namespace

std::optional<PrecisionTelemetry> precision_telemetry(internal::OptimizerRef optimizer) {
  const auto session = detail::require_step_session("amp::precision_telemetry");
  const auto& recorder = recorder_of(*session, "amp::precision_telemetry");
  session->require_step(optimizer.get(), "amp::precision_telemetry");
  return recorder.read(*optimizer.get());
}

std::vector<double> scale_history(int loss_id) {
  const auto session = detail::require_step_session("amp::scale_history");
  const auto& recorder = recorder_of(*session, "amp::scale_history");
  TORCH_CHECK(loss_id >= 0 && loss_id < session->num_losses(), "amp: scale_history got loss_id ", loss_id,
              ", but amp was initialized with num_losses=", session->num_losses(), " (loss_id 0..",
              session->num_losses() - 1, ").");
  return recorder.scale_history(loss_id);
}

std::vector<Fp8TensorTelemetry> fp8_telemetry() {
  const auto session = detail::require_step_session("amp::fp8_telemetry");
  recorder_of(*session, "amp::fp8_telemetry");
  TORCH_CHECK(session->fp8() != nullptr, "amp: amp::fp8_telemetry needs the fp8 property, which is off. Set "
              "PropertyOverrides::fp8 = true at O5 when calling amp::initialize.");
  return session->fp8()->telemetry(*session->parameter_names());
}

std::vector<Fp8LayerChoice> fp8_choices() {
  const auto session = detail::require_step_session("amp::fp8_choices");
  TORCH_CHECK(session->fp8() != nullptr, "amp: amp::fp8_choices needs the fp8 property, which is off. Set "
              "PropertyOverrides::fp8 = true at O5 when calling amp::initialize.");
  return session->fp8()->choices(*session->parameter_names());
}

}  // namespace amp
