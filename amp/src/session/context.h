// SPDX-License-Identifier: BSD-3-Clause
// Private: one live initialization of amp - its properties, loss scalers,
// dispatcher interception and the initializing thread's casting state. The
// top of the layers: it builds every layer's part and serves each layer
// the narrow view that layer asks for (CastingSession, StepSession,
// RecomputeSession); the public functions of this layer and persistence
// use it whole.
#pragma once

#include <amp/internal/loss_scaling.h>
#include <amp/options.h>

#include "distributed/data_parallel_step.h"
#include "distributed/gradient_reducer.h"
#include "distributed/sharded_optimizer.h"
#include "interception/casting_session.h"
#include "fp8/fp8_gemms.h"
#include "recompute/recompute_session.h"
#include "step/backward_step.h"
#include "step/fp8_step.h"
#include "step/step_session.h"

#include <torch/optim/optimizer.h>

#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace amp::detail {

class ForwardLog;
class Interceptor;
class RegistrationLock;
class ThreadCasting;

class Context final : public CastingSession, public StepSession, public RecomputeSession {
 public:
  // `held`: the user's registrations cannot change while the interceptor
  // reads them (see start_live_context). `weights`: the models' lowered
  // weights; `optimizers`: the program's optimizers, stepped through
  // OptimizerStep state machines; `sharded`: their sharding
  // (data_parallel.shard), or null.
  Context(const Properties& properties, const Options& options, const RegistrationLock& held,
          std::unique_ptr<ModelWeights> weights,
          const std::vector<torch::optim::Optimizer*>& optimizers,
          std::shared_ptr<const ParameterNames> parameter_names,
          std::unique_ptr<ShardedMasters> sharded, NamedBuffers model_buffers);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  const Properties& properties() const override { return properties_; }
  int verbosity() const override { return options_.verbosity; }
  int num_losses() const override { return static_cast<int>(scalers_.size()); }
  internal::LossScaling& scaler(int loss_id) override { return *shared_scaler(loss_id); }
  std::shared_ptr<internal::LossScaling> shared_scaler(int loss_id);
  SkipLog& skip_log(int loss_id) override { return skip_logs_.at(loss_id); }
  // Options::overflow_provenance, and the names its reports use.
  bool provenance() const override { return options_.overflow_provenance; }
  const std::shared_ptr<const ParameterNames>& parameter_names() const override { return parameter_names_; }
  // The models' buffers, named as parameter_names() names parameters.
  const NamedBuffers& model_buffers() const override { return model_buffers_; }
  // Where forward ops record for provenance; null when it is off or at O0.
  ForwardLog* forward_log() const override { return forward_log_.get(); }
  // Options::precision_telemetry's records; null when it is off.
  TelemetryParticipant* telemetry() const override { return telemetry_.get(); }
  // How the fused optimizers round updates into bf16 weights
  // (Properties::stochastic_rounding); null without it.
  StochasticRounding* rounding() const override { return rounding_.get(); }

  // How this initialization casts per device; empty when it does not
  // intercept ops (O0).
  const std::vector<DeviceCasting>& casting() const override { return casting_; }

  ModelWeights& weights() override { return *weights_; }
  // The state machine of an optimizer passed to initialize, or null.
  OptimizerStep* step_of(const torch::optim::Optimizer& optimizer) override;

  // An error a guard's destructor could not throw; the next guard raises it.
  void defer_error(std::exception_ptr error) override { deferred_error_ = std::move(error); }
  void rethrow_deferred_error() override;

  // Applies a user registration (register_op) to the interceptor; the
  // caller holds the RegistrationLock.
  void set_user_policy(const c10::OperatorName& op, c10::DeviceType device, CastPolicy policy) override;

  // Removes every dispatcher registration and the owner thread's casting
  // state. Idempotent. Errors leave everything in place.
  void shutdown();
  bool live() const { return !shut_down_; }
  std::thread::id owner() const override { return owner_; }

  bool add_worker() override;
  void remove_worker() override;

  // Options::data_parallel: averages each guard's gradients across ranks;
  // null in one process.
  GradientReducer* reducer() const { return reducer_.get(); }
  // Options::data_parallel.shard: the optimizers' sharded masters; null
  // without it.
  ShardedMasters* sharded() const { return sharded_.get(); }
  // Data parallel, telemetry and provenance, in the order guards run them.
  const std::vector<StepParticipant*>& participants() const override { return participants_; }
  Fp8Gemms* fp8() const override { return fp8_.get(); }
  // Adds `participant` after those initialize made: guards opened from now
  // on run its hooks last (and unwind it first). It must outlive them.
  void join(StepParticipant& participant) { participants_.push_back(&participant); }

 private:
  void teardown();

  Properties properties_;
  Options options_;
  std::unique_ptr<ForwardLog> forward_log_;  // before casting_, which points to it
  std::unique_ptr<Fp8Gemms> fp8_;            // before casting_, which points to it
  std::vector<DeviceCasting> casting_;
  std::vector<std::shared_ptr<internal::LossScaling>> scalers_;  // shared: amp::loss_scaler()
  std::vector<SkipLog> skip_logs_;
  std::shared_ptr<const ParameterNames> parameter_names_;
  NamedBuffers model_buffers_;
  std::unique_ptr<TelemetryParticipant> telemetry_;
  std::unique_ptr<StochasticRounding> rounding_;
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<Interceptor> interceptor_;
  std::unique_ptr<ThreadCasting> owner_casting_;
  std::thread::id owner_;
  bool shut_down_ = false;
  std::unique_ptr<ShardedMasters> sharded_;  // before weights_, which points to it
  std::unique_ptr<ModelWeights> weights_;
  std::unordered_map<const torch::optim::Optimizer*, std::unique_ptr<OptimizerStep>> steps_;
  std::unique_ptr<DataParallelParticipant> data_parallel_;
  std::unique_ptr<ProvenanceParticipant> provenance_;
  std::unique_ptr<Fp8Participant> fp8_step_;
  std::unique_ptr<BackwardStepParticipant> backward_step_;
  std::vector<StepParticipant*> participants_;
  std::exception_ptr deferred_error_;
  std::mutex workers_mutex_;
  int workers_ = 0;
  bool closing_ = false;  // shutdown has begun: no new workers
};

// The live context is the one record of "amp is live": at most one exists,
// published by start_live_context and cleared by end_live_context (both
// serialized by amp::initialize's own lock, and both holding the
// RegistrationLock so that user registrations reach exactly the live one).

// The live context, or null.
std::shared_ptr<Context> live_context();
// Like live_context(), but throws "amp is not initialized" with `what`.
std::shared_ptr<Context> require_live_context(const char* what);
// Builds a context and makes it the live one.
std::shared_ptr<Context> start_live_context(const Properties& properties, const Options& options,
                                            std::unique_ptr<ModelWeights> weights,
                                            const std::vector<torch::optim::Optimizer*>& optimizers,
                                            std::shared_ptr<const ParameterNames> parameter_names,
                                            std::unique_ptr<ShardedMasters> sharded, NamedBuffers model_buffers);
// The live initialization's state machine of `optimizer`, or null when amp
// is not live or the optimizer was not passed to it.
OptimizerStep* live_optimizer_step(const torch::optim::Optimizer& optimizer);
// Shuts `context` (the live one) down and clears the live slot. On error
// (see Context::shutdown) it stays live.
void end_live_context(const std::shared_ptr<Context>& context);

}  // namespace amp::detail
