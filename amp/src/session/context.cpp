// SPDX-License-Identifier: BSD-3-Clause
#include "session/context.h"

#include <amp/cast_cache.h>
#include <amp/hardware.h>

#include "distributed/replicas.h"
#include "interception/casting_scope_internal.h"
#include "interception/dispatch/call_record.h"
#include "interception/dispatch/forward_watch.h"
#include "interception/dispatch/interceptor.h"
#include "support/log.h"
#include "optim/optimizer_kinds.h"
#include "interception/policy_registry.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <mutex>

namespace amp::detail {
namespace {

std::mutex g_live_mutex;
std::shared_ptr<Context> g_live;

// Each lower layer's view of the live context, in that layer's slot; each
// shares ownership of all of it.
void publish(const std::shared_ptr<Context>& context) {
  live_casting_slot().set(context);
  live_step_slot().set(context);
  live_recompute_slot().set(context);
}

// `o`: the context's own options, which the casting points into.
std::vector<DeviceCasting> casting_for(const Properties& p, const Options& o, ModelWeights* weights,
                                       ForwardLog* forward_log, Fp8Gemms* fp8) {
  if (!p.intercepts_ops()) return {};
  const bool weights_decide = p.weights_decide_op_dtype();
  const bool fp32_ops = p.runs_fp32_policies();
  ModelWeights* lowered = weights->mode() == ModelWeights::Mode::kNone ? nullptr : weights;
  return {
      {c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU, p.cpu_dtype, weights_decide, fp32_ops,
       o.allow_banned, cpu_precision().onednn_supports(p.cpu_dtype), lowered, forward_log, fp8,
       &o.measured_policy_timer},
      {c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA, p.cuda_dtype, weights_decide,
       fp32_ops, o.allow_banned, true, lowered, forward_log, fp8, &o.measured_policy_timer},
  };
}

}  // namespace

Context::Context(const Properties& properties, const Options& options, const RegistrationLock& held,
                 std::unique_ptr<ModelWeights> weights,
                 const std::vector<torch::optim::Optimizer*>& optimizers,
                 std::shared_ptr<const ParameterNames> parameter_names,
                 std::unique_ptr<ShardedMasters> sharded, NamedBuffers model_buffers)
    : properties_(properties),
      options_(options),
      forward_log_(options.overflow_provenance && properties.intercepts_ops() ? std::make_unique<ForwardLog>()
                                                                              : nullptr),
      fp8_(properties.fp8 ? std::make_unique<Fp8Gemms>(options.fp8_scaling, options.precision_telemetry) : nullptr),
      casting_(casting_for(properties, options_, weights.get(), forward_log_.get(), fp8_.get())),
      owner_(std::this_thread::get_id()),
      sharded_(std::move(sharded)),
      weights_(std::move(weights)) {
  if (sharded_) {
    weights_->set_sharded(sharded_.get());
    sharded_->record_members();
    sharded_->free_weights();  // shard_weights: each rank keeps its pieces alone
  }
  parameter_names_ = std::move(parameter_names);
  model_buffers_ = std::move(model_buffers);
  if (options.precision_telemetry) {
    telemetry_ = std::make_unique<TelemetryParticipant>(
        options.num_losses, parameter_names_,
        [p = properties_](c10::DeviceType device) { return p.low_precision_dtype(device); });
  }
  if (properties.stochastic_rounding || properties.optimizer_state_dtype == at::kByte) {  // rounds weights or 8-bit state
    uint64_t seed = at::detail::getDefaultCPUGenerator().current_seed();
    const c10::intrusive_ptr<c10d::Backend>& group = options.data_parallel.group;
    if (group) seed = rank0_seed(seed, *group);
    rounding_ = std::make_unique<StochasticRounding>(seed, sharded_ ? group->getRank() : 0, properties.stochastic_rounding);
  }
  for (torch::optim::Optimizer* optimizer : optimizers) {
    steps_[optimizer] = std::make_unique<OptimizerStep>(*optimizer, fused_optimizer(*optimizer));
  }
  for (int i = 0; i < options.num_losses; ++i) {
    scalers_.push_back(
        std::make_shared<internal::LossScaling>(properties.loss_scale, properties.dynamic_scaling, i));
  }
  skip_logs_.resize(scalers_.size());
  if (!casting_.empty()) {
    interceptor_ = std::make_unique<Interceptor>(casting_, held);
    owner_casting_ = std::make_unique<ThreadCasting>(casting_);
  }
  if (forward_log_) g_observers.fetch_or(kForwardWatch);
  if (options.measured_policy) g_observers.fetch_or(kMeasuredPolicy);
  // The step's participants (step/step_participant.h), in the order their
  // parts run (unwound in reverse): data parallel first, so every later
  // part sees the gradients reduced and the overflow flag agreed by all
  // ranks; telemetry records those gradients; provenance names the op
  // behind a verdict; fp8 updates its scales last, once the step is known
  // to commit; the step in backward (which refuses the others but fp8's,
  // and fp8 needs masters, which it refuses too) stands alone. A new
  // participant is its own file and one entry here.
  if (options.data_parallel.group) reducer_ = std::make_unique<GradientReducer>(options.data_parallel);
  // Options::reduce_overflow, or with sharding amp's own (each rank checks
  // only its shard): all ranks skip together.
  std::function<void(at::Tensor&)> reduce_overflow = options.reduce_overflow;
  if (sharded_) reduce_overflow = overflow_all_reduce(sharded_->group());
  if (reducer_ || reduce_overflow) {
    data_parallel_ = std::make_unique<DataParallelParticipant>(reducer_.get(), sharded_.get(), std::move(reduce_overflow));
    participants_.push_back(data_parallel_.get());
  }
  if (telemetry_) participants_.push_back(telemetry_.get());
  if (options.overflow_provenance) {
    provenance_ = std::make_unique<ProvenanceParticipant>();
    participants_.push_back(provenance_.get());
  }
  if (fp8_) {
    fp8_step_ = std::make_unique<Fp8Participant>(*fp8_);
    participants_.push_back(fp8_step_.get());
  }
  if (properties.step_in_backward) {
    backward_step_ = std::make_unique<BackwardStepParticipant>();
    participants_.push_back(backward_step_.get());
  }
}

Context::~Context() {
  if (shut_down_) return;
  if (std::this_thread::get_id() != owner_ && owner_casting_) {
    log_error("amp's context is destroyed on another thread than the one that initialized it; "
              "that thread's autocast state stays enabled. Call amp::deinitialize() on the "
              "initializing thread.");
    (void)owner_casting_.release();  // restoring it here would edit this thread's state
  }
  teardown();
}

void Context::teardown() {
  g_observers.fetch_and(~kMeasuredPolicy);
  if (forward_log_) {
    g_observers.fetch_and(~kForwardWatch);
    forward_log_->clear();
  }
  interceptor_.reset();
  owner_casting_.reset();
  clear_cast_cache();
  weights_->finish_backward();  // O2/O5 models end in float32
  for (auto& [optimizer, step] : steps_) {
    try {
      step->catch_up();  // host step counts of pending and replayed fused steps
    } catch (const std::exception& e) {
      log_error(e.what());
    }
  }
  if (sharded_) {  // the optimizers get their parameters back, in float32 with whole state
    try {
      for (const auto& s : sharded_->optimizers()) s->restore();
    } catch (const std::exception& e) {
      log_error(std::string("giving the optimizers back their whole parameters failed: ") + e.what());
    }
  }
  shut_down_ = true;
}

OptimizerStep* Context::step_of(const torch::optim::Optimizer& optimizer) {
  auto it = steps_.find(&optimizer);
  return it == steps_.end() ? nullptr : it->second.get();
}

void Context::rethrow_deferred_error() {
  if (deferred_error_) std::rethrow_exception(std::exchange(deferred_error_, nullptr));
}

std::shared_ptr<internal::LossScaling> Context::shared_scaler(int loss_id) {
  TORCH_CHECK(loss_id >= 0 && loss_id < num_losses(), "amp: loss_id ", loss_id,
              " is out of range: amp was initialized with num_losses=", num_losses(), ".");
  return scalers_[loss_id];
}

void Context::set_user_policy(const c10::OperatorName& op, c10::DeviceType device, CastPolicy policy) {
  if (interceptor_) interceptor_->set_policy(op, device, policy);
}

void Context::shutdown() {
  if (shut_down_) return;
  TORCH_CHECK(std::this_thread::get_id() == owner_ || !owner_casting_,
              "amp: deinitialize() must run on the thread that called amp::initialize, which "
              "owns amp's casting state.");
  {
    std::lock_guard<std::mutex> lock(workers_mutex_);
    TORCH_CHECK(workers_ == 0, "amp: deinitialize() while ", workers_,
                " amp::enable_casts scope(s) are alive on other threads; end them first.");
    closing_ = true;
  }
  teardown();
}

bool Context::add_worker() {
  std::lock_guard<std::mutex> lock(workers_mutex_);
  if (closing_) return false;
  ++workers_;
  return true;
}

void Context::remove_worker() {
  std::lock_guard<std::mutex> lock(workers_mutex_);
  --workers_;
}

std::shared_ptr<Context> live_context() {
  std::lock_guard<std::mutex> lock(g_live_mutex);
  return g_live;
}

std::shared_ptr<Context> require_live_context(const char* what) {
  std::shared_ptr<Context> context = live_context();
  TORCH_CHECK(context != nullptr, "amp: ", what, " needs amp to be initialized; call "
              "amp::initialize(model, optimizer, opt_level) first.");
  return context;
}

std::shared_ptr<Context> start_live_context(const Properties& properties, const Options& options,
                                            std::unique_ptr<ModelWeights> weights,
                                            const std::vector<torch::optim::Optimizer*>& optimizers,
                                            std::shared_ptr<const ParameterNames> parameter_names,
                                            std::unique_ptr<ShardedMasters> sharded, NamedBuffers model_buffers) {
  const RegistrationLock held;
  auto context = std::make_shared<Context>(properties, options, held, std::move(weights), optimizers,
                                           std::move(parameter_names), std::move(sharded),
                                           std::move(model_buffers));
  std::lock_guard<std::mutex> lock(g_live_mutex);
  g_live = context;
  publish(context);
  return context;
}

OptimizerStep* live_optimizer_step(const torch::optim::Optimizer& optimizer) {
  const std::shared_ptr<Context> context = live_context();
  return context ? context->step_of(optimizer) : nullptr;
}

void end_live_context(const std::shared_ptr<Context>& context) {
  const RegistrationLock held;
  context->shutdown();
  std::lock_guard<std::mutex> lock(g_live_mutex);
  if (g_live != context) return;
  publish(nullptr);
  g_live.reset();
}

}  // namespace amp::detail
