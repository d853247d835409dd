// SPDX-License-Identifier: BSD-3-Clause
// Private: the overflow verdict of one scale_loss guard, and how the host
// learns it.
//
// A guard that unscales gradients updates its loss scaler on the device and
// leaves a verdict: a 3-element device snapshot [found_inf, scale before,
// scale after]. Nothing is read on the host then. The optimizers the guard
// covered queue the verdict. At their next step() either
//   - the host reads every queued verdict in one host sync (read_verdicts)
//     and skips the step if any says overflow, or
//   - a fused optimizer kernel takes the overflow flag and skips on the
//     device; the verdicts then travel to the host without blocking
//     (DeferredVerdicts) and are logged and counted once they arrive.
#pragma once

#include "step/overflow_provenance.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <memory>
#include <optional>
#include <vector>

namespace amp::detail {

class StepSession;

struct OverflowVerdict {
  at::Tensor snapshot;  // [found_inf, scale before, scale after] on the device
  int loss_id = 0;
  std::shared_ptr<StepSession> session;  // keeps the initialization alive
  bool resolved = false;
  bool overflow = false;
  double scale_before = 0;
  double scale_after = 0;
  // Options::overflow_provenance: the guard's device records, and once an
  // overflow is resolved, the report built from them.
  std::shared_ptr<ProvenanceTrace> trace;
  std::shared_ptr<const OverflowReport> report;
};


using Verdicts = std::vector<std::shared_ptr<OverflowVerdict>>;
// Verdicts as the functions below read them: a guard's one verdict is passed
// without building a vector.
using VerdictsView = c10::ArrayRef<std::shared_ptr<OverflowVerdict>>;

// The report of the first overflowed verdict in `verdicts` that has one.
std::shared_ptr<const OverflowReport> report_of(VerdictsView verdicts);

// Reads every unresolved verdict in `verdicts` with one host sync, logs each
// overflow (concisely: no flood when the scale sits at its floor), and
// returns whether any overflowed. Errors: an overflow with the scaler at its
// floor and AtFloor::kRaise (the verdicts are resolved either way).
bool read_verdicts(VerdictsView verdicts);

// The overflow flag of unresolved `verdicts` for a fused optimizer kernel:
// a 1-element float32 tensor on their device, exactly 1 when any overflowed
// and 0 otherwise (the kernels skip only on exactly 1; an all-reduced flag
// can be larger). No host read.
at::Tensor combined_found_inf(const Verdicts& verdicts);

// Verdicts of a step the device decided, on their way to the host: the
// copy starts without blocking and resolve() reads it once it arrived.
class DeferredVerdicts {
 public:
  explicit DeferredVerdicts(Verdicts verdicts);
  // Whether the values reached the host (always, for verdicts on the CPU).
  bool ready() const;
  // Resolves the verdicts as read_verdicts does (logs, the at-floor error)
  // and returns whether the step was skipped. Waits for the copy if it has
  // not arrived: that wait is a host sync and is counted.
  bool resolve();
  std::shared_ptr<const OverflowReport> report() const { return report_of(verdicts_); }

 private:
  Verdicts verdicts_;
  c10::SmallVector<size_t, 4> copied_;  // indices into verdicts_ whose snapshots host_ holds
  at::Tensor host_;
  std::optional<c10::Event> arrived_;  // recorded after the copy (GPU only)
};


}  // namespace amp::detail
