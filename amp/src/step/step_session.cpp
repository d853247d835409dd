// SPDX-License-Identifier: BSD-3-Clause
#include "step/step_session.h"

#include "optim/optimizer_state_load.h"

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

std::optional<optim::internal::UpdatePrecision> update_precision(StepSession& session) {
  if (session.rounding() == nullptr) return std::nullopt;  // it exists where the session rounds
  const Properties& p = session.properties();
  return optim::internal::UpdatePrecision{session.rounding(), p.stochastic_rounding, p.optimizer_state_dtype};
}

void pack_loaded_state(torch::optim::Optimizer& optimizer, const optim::internal::UpdatePrecision* precision) {
  if (precision == nullptr || precision->state_dtype != at::kByte) return;
  convert_state(optimizer, [precision](const at::Tensor& p) { return optim::internal::state_dtype_of(p, precision); });
}

}  // namespace amp::detail
