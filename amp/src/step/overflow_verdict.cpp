// SPDX-License-Identifier: BSD-3-Clause
#include "step/overflow_verdict.h"

#include <amp/loss_scaler.h>
#include <amp/testing.h>

#include "step/step_session.h"
#include "support/host_read.h"
#include "support/log.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <sstream>

namespace amp {
namespace detail {
namespace {


// ". First inf/NaN in forward: aten::linear (module fc2, Half), from finite
// inputs. First in backward: MmBackward0 (module fc2, Half). Non-finite
// gradients: fc2.weight."
std::string describe(const OverflowReport& r) {
  std::ostringstream out;
  auto where = [&](const NonFiniteOp& op) {
    out << op.op << " (" << (op.module.empty() ? "" : "module " + op.module + ", ") << c10::toString(op.dtype)
        << ")";
  };
  if (r.forward) {
    out << ". First inf/NaN in forward: ";
    where(*r.forward);
    out << (r.forward->input_non_finite ? ", which read an inf/NaN already there (a parameter, the data, or an "
                                          "op under NoGradGuard)"
                                        : ", from finite inputs");
  }
  if (r.backward) {
    out << ". First inf/NaN produced in backward: ";
    where(*r.backward);
  } else {
    out << ". No backward node produced an inf/NaN from finite gradients";
  }
  if (!r.non_finite_gradients.empty()) {
    out << ". Non-finite gradients:";
    for (size_t i = 0; i < r.non_finite_gradients.size(); ++i) {
      out << (i ? ", " : " ") << r.non_finite_gradients[i];
    }
  }
  return out.str();
}

void log_overflow(const OverflowVerdict& v) {
  StepSession& ctx = *v.session;
  SkipLog& log = ctx.skip_log(v.loss_id);
  log.consecutive = v.overflow ? log.consecutive + 1 : 0;
  constexpr int kLoggedInARow = 5;  // then one notice, then silence until a clean step
  if (!v.overflow || ctx.verbosity() < 1 || log.consecutive > kLoggedInARow + 1) return;
  LogEvent event{LogEvent::Kind::kStepSkipped, "", "", v.loss_id, v.scale_before, v.scale_after};
  std::ostringstream line;
  if (log.consecutive == kLoggedInARow + 1) {
    event.kind = LogEvent::Kind::kSkipsSuppressed;
    line << "loss scaler " << v.loss_id << ": " << kLoggedInARow
         << " overflows in a row, loss scale " << v.scale_after
         << "; further skip messages are suppressed until a step succeeds.";
  } else if (v.scale_after < v.scale_before) {
    line << "Gradient overflow. Skipping step, loss scaler " << v.loss_id
         << " reducing loss scale to " << v.scale_after;
  } else {
    line << "Gradient overflow. Skipping step, loss scaler " << v.loss_id
         << " keeping loss scale " << v.scale_after
         << (v.scale_after <= ctx.scaler(v.loss_id).floor() ? " (its floor)" : " (hysteresis)");
  }
  if (v.report && log.consecutive <= kLoggedInARow) line << describe(*v.report);
  event.message = line.str();
  emit(event);
}

// Resolves the verdicts `which` indexes in `verdicts` from `values`, three
// floats each in that order (verdicts resolved meanwhile are left alone).
void resolve_from(VerdictsView verdicts, c10::ArrayRef<size_t> which, const float* values) {
  for (size_t k = 0; k < which.size(); ++k) {
    OverflowVerdict& v = *verdicts[which[k]];
    if (v.resolved) continue;
    v.overflow = values[3 * k] > 0;
    v.scale_before = values[3 * k + 1];
    v.scale_after = values[3 * k + 2];
    v.resolved = true;
    v.snapshot = at::Tensor();
    if (v.overflow && v.trace) {
      v.report = std::make_shared<const OverflowReport>(v.trace->report(v.loss_id, v.scale_before));
    }
    v.trace.reset();
    log_overflow(v);
  }
}

// Unresolved verdicts' indices and their snapshots, concatenated.
std::pair<c10::SmallVector<size_t, 4>, at::Tensor> unresolved(VerdictsView verdicts) {
  c10::SmallVector<size_t, 4> which;
  c10::SmallVector<at::Tensor, 4> snapshots;
  for (size_t i = 0; i < verdicts.size(); ++i) {
    if (verdicts[i]->resolved) continue;
    which.push_back(i);
    snapshots.push_back(verdicts[i]->snapshot);
  }
  if (snapshots.size() == 1) return {which, snapshots[0]};
  return {which, snapshots.empty() ? at::Tensor() : at::cat(snapshots)};
}

// Whether resolved `verdicts` skip the step.
bool judge(VerdictsView verdicts) {
  bool skip = false;
  for (const auto& v : verdicts) {
    skip = skip || v->overflow;
    const LossScaler& scaler = v->session->scaler(v->loss_id);
    TORCH_CHECK(!(v->overflow && scaler.dynamic_scaling().at_floor == DynamicScaling::AtFloor::kRaise &&
                  v->scale_before <= scaler.floor()),
                "amp: gradients overflowed with loss scaler ", v->loss_id,
                " already at its floor min_loss_scale=", scaler.floor(),
                ", so training cannot progress. Look for inf/NaN in the loss, inputs or "
                "weights, or lower the learning rate; set DynamicScaling::at_floor = "
                "DynamicScaling::AtFloor::kHold to keep skipping instead. This step was skipped.");
  }
  return skip;
}

}  // namespace

std::shared_ptr<const OverflowReport> report_of(VerdictsView verdicts) {
  for (const auto& v : verdicts) {
    if (v->overflow && v->report) return v->report;
  }
  return nullptr;
}

bool read_verdicts(VerdictsView verdicts) {
  const auto [which, snapshots] = unresolved(verdicts);
  if (!which.empty()) {
    const at::Tensor host = snapshots.is_cpu() ? snapshots : snapshots.cpu();  // the one host sync of the step
    count_host_read();
    resolve_from(verdicts, which, host.data_ptr<float>());
  }
  return judge(verdicts);
}

at::Tensor combined_found_inf(const Verdicts& verdicts) {
  std::vector<at::Tensor> flags;
  for (const auto& v : verdicts) flags.push_back(v->snapshot.narrow(0, 0, 1));
  const at::Tensor any = flags.size() == 1 ? flags[0] : at::cat(flags).amax(0, /*keepdim=*/true);
  return any.clamp_max(1.0);
}

DeferredVerdicts::DeferredVerdicts(Verdicts verdicts) : verdicts_(std::move(verdicts)) {
  auto [which, snapshots] = unresolved(verdicts_);
  copied_ = std::move(which);
  if (copied_.empty() || snapshots.is_cpu()) {
    host_ = snapshots;
    return;
  }
  host_ = at::empty(snapshots.sizes(), snapshots.options().device(at::kCPU).pinned_memory(true));
  host_.copy_(snapshots, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl device(snapshots.device().type());
  arrived_.emplace(snapshots.device().type());
  arrived_->record(device.getStream(snapshots.device()));
}

bool DeferredVerdicts::ready() const { return !arrived_ || arrived_->query(); }

bool DeferredVerdicts::resolve() {
  if (!ready()) {
    arrived_->synchronize();
    count_host_read();
  }
  if (!copied_.empty()) resolve_from(verdicts_, copied_, host_.data_ptr<float>());
  return judge(verdicts_);
}

}  // namespace detail

int64_t host_syncs() { return detail::host_reads(); }

}  // namespace amp
