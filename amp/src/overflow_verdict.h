// Private: the overflow verdict of one scale_loss guard, and the one host
// read per step that turns queued verdicts into a skip decision.
//
// A guard that unscales gradients updates its loss scaler on the device and
// leaves a verdict: a 3-element device snapshot [found_inf, scale before,
// scale after]. Nothing is read on the host then. The optimizers the guard
// covered queue the verdict; their next step() reads every queued verdict in
// one host sync (read_verdicts) and is skipped if any says overflow.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace amp::detail {

class Context;

struct OverflowVerdict {
  at::Tensor snapshot;  // [found_inf, scale before, scale after] on the device
  int loss_id = 0;
  std::shared_ptr<Context> context;
  bool resolved = false;
  bool overflow = false;
  double scale_before = 0;
  double scale_after = 0;
};

using Verdicts = std::vector<std::shared_ptr<OverflowVerdict>>;

// Reads every unresolved verdict in `verdicts` with one host sync, logs each
// overflow (concisely: no flood when the scale sits at its floor), and
// returns whether any overflowed. Errors: an overflow with the scaler at its
// floor and AtFloor::kRaise (the verdicts are resolved either way).
bool read_verdicts(const Verdicts& verdicts);

// The number of host reads read_verdicts has made (amp::host_syncs()).
int64_t verdict_host_reads();

}  // namespace amp::detail
