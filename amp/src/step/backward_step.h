// SPDX-License-Identifier: BSD-3-Clause
// Private: Properties::step_in_backward - the step applied during backward.
//
// While a guard is open, each parameter of its optimizers is stepped as
// soon as its gradient is final (its gradient accumulator ran, the
// autograd engine having summed every path into it): the gradient is
// unscaled as the guard's unscale would (a static scale never skips),
// stepped by the optimizer's fused kernel alone, and freed. A step never
// holds all gradients, only those backward has produced and not yet
// reached the accumulator. The result is the ordinary step's, bit for bit:
// the kernels are elementwise, and each tensor's stochastic rounding draws
// from its own stream (stochastic_rounding.h).
//
// When the guard ends, parameters backward did not reach but which held a
// gradient from before the guard are stepped then, as step() would have.
// The optimizer's step() afterwards applies nothing; it ends the
// iteration (optimizer_step.h). Steps already applied stay applied if an
// exception leaves the guard mid-backward: an update cannot be taken back.
#pragma once

#include "step/step_participant.h"

namespace amp::detail {

class BackwardStepParticipant final : public StepParticipant {
 public:
  // Refuses delay_unscale (the step would come before the last
  // micro-batch) and a CUDA graph capture.
  void check_open(const Guard& guard) const override;
  std::unique_ptr<GuardPart> open(Guard& guard) override;
};

}  // namespace amp::detail
