#include "step/step_session.h"

#include <c10/util/Exception.h>

namespace amp::detail {

LiveSlot<StepSession>& live_step_slot() {
  static LiveSlot<StepSession> slot;
  return slot;
}

OptimizerStep& StepSession::require_step(const torch::optim::Optimizer* optimizer, const char* what) {
  TORCH_CHECK(optimizer != nullptr, "amp: ", what, " got a null optimizer.");
  OptimizerStep* step = step_of(*optimizer);
  TORCH_CHECK(step != nullptr, "amp: ", what, " got an optimizer that was not passed to the live "
              "amp::initialize; pass every optimizer that steps these parameters to "
              "amp::initialize(model, optimizer, opt_level).");
  return *step;
}

}  // namespace amp::detail
