// SPDX-License-Identifier: BSD-3-Clause
// amp::optim::Fused (fused.h): a fused optimizer's step() asks the live
// step whether and how to step, runs the kernels, and tells the step's
// participants it stepped.
#include <amp/fused.h>

#include "optim/fused_stepping.h"
#include "step/step_session.h"

#include <ATen/ATen.h>

#include <optional>

namespace amp::optim::internal {

Fused::Fused(const FusedKernel& kernel) : stepping_(std::make_unique<FusedStepping>(kernel)) {}
Fused::Fused(Fused&&) noexcept = default;
Fused::~Fused() = default;

// Returns false when LibTorch's own step must run instead.
bool Fused::fused_step(torch::optim::Optimizer& optimizer) {
  const std::shared_ptr<detail::StepSession> session = detail::live_step_session();
  detail::OptimizerStep* amp_step = session ? session->step_of(optimizer) : nullptr;
  std::optional<UpdatePrecision> precision;
  if (amp_step != nullptr) precision = detail::update_precision(*session);
  const UpdatePrecision* kept = precision ? &*precision : nullptr;
  detail::pack_loaded_state(optimizer, kept);
  const bool kernels = stepping_->suits(optimizer, kept);
  TORCH_CHECK(kernels || !kept || kept->state_dtype != at::kByte, "amp: optimizer_state_dtype uint8 keeps the "
              "optimizer's state in 8 bits, which only amp's fused kernels step, and they cannot step this "
              "optimizer now: they need every gradient dense, contiguous and of its parameter's dtype, and every "
              "parameter on one CPU or CUDA device. Make the gradients so (sparse=false embeddings, no gradient "
              "hooks that change their dtype), or keep the state in float32 (optimizer_state_dtype unset).");
  detail::OptimizerStep::FusedDecision decision;
  const bool rounds = kept != nullptr && (kept->rounds_weights || kept->state_dtype == at::kByte);
  if (amp_step != nullptr) decision = amp_step->begin_fused_step(kernels, rounds);
  if (decision.skip) return true;
  if (!kernels) {
    stepping_->reset();  // LibTorch's step counts on the host
    return false;
  }
  FusedAttempt attempt = stepping_->step(optimizer, decision.found_inf, kept);
  if (amp_step != nullptr) {
    amp_step->end_fused_step(std::move(attempt), std::move(decision));
  } else {
    stepping_->settle(attempt, /*skipped=*/false, optimizer.state());
  }
  return true;
}

void Fused::stepped(const torch::optim::Optimizer& optimizer) {
  const std::shared_ptr<detail::StepSession> session = detail::live_step_session();
  if (!session || session->step_of(optimizer) == nullptr) return;
  for (detail::StepParticipant* p : session->participants()) p->after_fused_step(optimizer);
}

at::Tensor Fused::run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode grad(true);
  return closure();
}

void Fused::reset_stepping() { stepping_->reset(); }

}  // namespace amp::optim::internal
