// SPDX-License-Identifier: BSD-3-Clause
// Private: the live initialization as the training step sees it - the loss
// scalers, one state machine per optimizer, and the participants that join
// each guard. The session (session/context.h) implements it; the step and
// the layers above it ask for it here.
#pragma once

#include <amp/internal/loss_scaling.h>
#include <amp/options.h>

#include "fp8/fp8_gemms.h"
#include "model/model_weights.h"
#include "optim/fused_kernel.h"
#include "optim/stochastic_rounding.h"
#include "step/optimizer_step.h"
#include "step/overflow_provenance.h"
#include "step/precision_telemetry.h"
#include "step/step_participant.h"
#include "support/live_slot.h"

#include <torch/optim/optimizer.h>

#include <exception>
#include <memory>
#include <optional>
#include <vector>

namespace amp::detail {

// Host-side count of consecutive skipped steps per loss, to keep the log
// concise when the scale sits at its floor.
struct SkipLog {
  int consecutive = 0;
};

class StepSession {
 public:
  virtual const Properties& properties() const = 0;
  virtual int verbosity() const = 0;
  virtual int num_losses() const = 0;
  virtual internal::LossScaling& scaler(int loss_id) = 0;
  virtual SkipLog& skip_log(int loss_id) = 0;
  virtual ModelWeights& weights() = 0;
  // The state machine of an optimizer passed to initialize, or null.
  virtual OptimizerStep* step_of(const torch::optim::Optimizer& optimizer) = 0;
  // Like step_of, but throws "not passed to amp::initialize" for `what`.
  OptimizerStep& require_step(const torch::optim::Optimizer* optimizer, const char* what);
  // In the order each guard runs their parts.
  virtual const std::vector<StepParticipant*>& participants() const = 0;
  // Options::overflow_provenance, and the names its reports use.
  virtual bool provenance() const = 0;
  virtual const std::shared_ptr<const ParameterNames>& parameter_names() const = 0;
  // Where forward ops record for provenance; null when it is off or at O0.
  virtual ForwardLog* forward_log() const = 0;
  // Options::precision_telemetry's records; null when it is off.
  virtual TelemetryParticipant* telemetry() const = 0;
  // The fp8 property's GEMM sites; null without it.
  virtual Fp8Gemms* fp8() const = 0;
  // How the fused optimizers round updates into bf16 weights
  // (Properties::stochastic_rounding); null without it.
  virtual StochasticRounding* rounding() const = 0;

  // An error a guard's destructor could not throw; the next guard raises it.
  virtual void defer_error(std::exception_ptr error) = 0;
  virtual void rethrow_deferred_error() = 0;

 protected:
  ~StepSession() = default;
};

// How amp's fused kernels keep what they step in `session` (O6's rounded
// weights, 8-bit state), the rounding step not yet drawn; nullopt where
// they step values as they are.
std::optional<optim::internal::UpdatePrecision> update_precision(StepSession& session);
// With 8-bit state: packs the state `optimizer` loaded or held before
// initialize; packed state stays as it is.
void pack_loaded_state(torch::optim::Optimizer& optimizer, const optim::internal::UpdatePrecision* precision);

// The live session: published by the session layer (support/live_slot.h).
LiveSlot<StepSession>& live_step_slot();
inline std::shared_ptr<StepSession> live_step_session() { return live_step_slot().get(); }
inline std::shared_ptr<StepSession> require_step_session(const char* what) { return live_step_slot().require(what); }

}  // namespace amp::detail
