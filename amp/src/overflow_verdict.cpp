#include "overflow_verdict.h"

#include <amp/loss_scaler.h>

#include "context.h"
#include "log.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <sstream>

namespace amp {
namespace detail {
namespace {

std::atomic<int64_t> g_host_reads{0};

void log_overflow(const OverflowVerdict& v) {
  Context& ctx = *v.context;
  SkipLog& log = ctx.skip_log(v.loss_id);
  log.consecutive = v.overflow ? log.consecutive + 1 : 0;
  constexpr int kLoggedInARow = 5;  // then one notice, then silence until a clean step
  if (!v.overflow || ctx.verbosity() < 1 || log.consecutive > kLoggedInARow + 1) return;
  std::ostringstream line;
  if (log.consecutive == kLoggedInARow + 1) {
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
  log_line(line.str());
}

}  // namespace

bool read_verdicts(const Verdicts& verdicts) {
  std::vector<at::Tensor> unread;
  for (const auto& v : verdicts) {
    if (!v->resolved) unread.push_back(v->snapshot);
  }
  if (!unread.empty()) {
    const at::Tensor host = at::cat(unread).cpu();  // the one host sync of the step
    g_host_reads.fetch_add(1, std::memory_order_relaxed);
    const float* values = host.data_ptr<float>();
    size_t k = 0;
    for (const auto& v : verdicts) {
      if (v->resolved) continue;
      v->overflow = values[3 * k] > 0;
      v->scale_before = values[3 * k + 1];
      v->scale_after = values[3 * k + 2];
      v->resolved = true;
      v->snapshot = at::Tensor();
      ++k;
      log_overflow(*v);
    }
  }
  bool skip = false;
  for (const auto& v : verdicts) {
    skip = skip || v->overflow;
    const LossScaler& scaler = v->context->scaler(v->loss_id);
    TORCH_CHECK(!(v->overflow && scaler.dynamic_scaling().at_floor == AtFloor::kRaise &&
                  v->scale_before <= scaler.floor()),
                "amp: gradients overflowed with loss scaler ", v->loss_id,
                " already at its floor min_loss_scale=", scaler.floor(),
                ", so training cannot progress. Look for inf/NaN in the loss, inputs or "
                "weights, or lower the learning rate; set DynamicScaling::at_floor = "
                "AtFloor::kHold to keep skipping instead. This step was skipped.");
  }
  return skip;
}

int64_t verdict_host_reads() { return g_host_reads.load(std::memory_order_relaxed); }

}  // namespace detail

int64_t host_syncs() { return detail::verdict_host_reads(); }

}  // namespace amp
