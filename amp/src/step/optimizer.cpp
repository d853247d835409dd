#include <amp/optimizer.h>

#include "context.h"

namespace amp {
namespace {

detail::OptimizerStep& step_of(OptimizerRef optimizer, const char* what) {
  return detail::require_live_context(what)->require_step(optimizer.get(), what);
}

}  // namespace

std::vector<at::Tensor> master_params(OptimizerRef optimizer) {
  const detail::OptimizerStep& step = step_of(optimizer, "amp::master_params");
  std::vector<at::Tensor> out;
  for (const auto& group : step.optimizer().param_groups()) {
    out.insert(out.end(), group.params().begin(), group.params().end());
  }
  return out;
}

int64_t skipped_steps(OptimizerRef optimizer) {
  return step_of(optimizer, "amp::skipped_steps").skipped_steps();
}

bool last_step_skipped(OptimizerRef optimizer) {
  return step_of(optimizer, "amp::last_step_skipped").last_step_skipped();
}

}  // namespace amp
