#include <amp/scale_loss.h>

#include <amp/cast_cache.h>
#include <amp/casting_scope.h>

#include "context.h"
#include "step/graph_capture.h"
#include "step/non_finite_check.h"
#include "step/unscale_plan.h"
#include "trace_range.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <c10/util/Exception.h>

#include <exception>
#include <unordered_set>
#include <utility>
#include <vector>

namespace amp {

// The guard's transaction: what it covers, what it set aside, how far it got.
class scale_loss::State {
 public:
  enum class Stage { kOpen, kUnscaled, kFinished };

  State(const at::Tensor& loss, const std::vector<OptimizerRef>& optimizers, ScaleLossOptions options);

  void check_capturable(c10::Device device) const;
  void unscale_gradients();
  void check_kept_gradients();
  void commit();
  void unwind() noexcept;

  std::shared_ptr<detail::Context> context;
  std::vector<detail::OptimizerStep*> steps;  // of the optimizers passed in
  std::vector<detail::GradSlot> slots;        // their parameters
  // Options::data_parallel: the averaging backward started (destroyed
  // before the slots it reads).
  std::unique_ptr<detail::GradientReducer::Reduction> reduction;
  // Master weights of other optimizers, with the gradients they had: a
  // backward through them leaves scratch scaled by this loss, discarded.
  std::vector<std::pair<at::Tensor, at::Tensor>> held;
  ScaleLossOptions options;
  at::Tensor scaled_loss;
  uint64_t loss_graph = 0;  // the loss's root node's autograd sequence number
  bool passthrough = false;  // static scale 1 without masters: no multiply, no unscale
  Stage stage = Stage::kOpen;
  std::optional<internal::LossScaling::State> scaler_before;  // set by unscale(): to unwind its update
  std::shared_ptr<detail::OverflowVerdict> verdict;
  std::shared_ptr<detail::ProvenanceTrace> trace;  // Options::overflow_provenance
  int uncaught_at_entry = std::uncaught_exceptions();
  disable_casts no_casts;
};

scale_loss::State::State(const at::Tensor& loss, const std::vector<OptimizerRef>& optimizers,
                         ScaleLossOptions guard_options)
    : context(detail::require_live_context("amp::scale_loss")), options(guard_options) {
  context->rethrow_deferred_error();
  TORCH_CHECK(loss.defined(), "amp: scale_loss got an undefined loss tensor.");
  TORCH_CHECK(loss.is_floating_point(), "amp: scale_loss needs a floating-point loss, got ",
              loss.scalar_type());
  TORCH_CHECK(loss.numel() == 1, "amp: scale_loss needs a scalar loss (one element), got shape ",
              loss.sizes(), "; reduce it first, e.g. loss.mean().");
  TORCH_CHECK(options.loss_id >= 0 && options.loss_id < context->num_losses(), "amp: loss_id ",
              options.loss_id, " is out of range: amp was initialized with num_losses=",
              context->num_losses(), " (loss_id 0..", context->num_losses() - 1, ").");
  TORCH_CHECK(!optimizers.empty(), "amp: scale_loss needs the optimizer(s) that will step "
              "these gradients.");
  for (const OptimizerRef& ref : optimizers) {  // validate everything before changing anything
    detail::OptimizerStep& step = context->require_step(ref.get(), "amp::scale_loss");
    TORCH_CHECK(std::find(steps.begin(), steps.end(), &step) == steps.end(),
                "amp: scale_loss got the same optimizer twice.");
    step.check_can_open(options.loss_id, options.delay_unscale);
    steps.push_back(&step);
  }
  detail::ModelWeights& weights = context->weights();
  const LossScale& configured = context->properties().loss_scale;
  passthrough = !configured.dynamic && configured.value == 1.0 &&
                weights.mode() != detail::ModelWeights::Mode::kMasters;
  if (!passthrough && detail::capturing(loss.device())) {
    try {
      check_capturable(loss.device());
    } catch (...) {
      clear_cast_cache();  // casts the capture recorded but never ran
      throw;
    }
  }
  weights.prepare_backward();
  for (detail::OptimizerStep* step : steps) step->settle_before_guard();

  // Everything is checked; from here on the guard changes state.
  std::unordered_set<const c10::TensorImpl*> covered;
  for (detail::OptimizerStep* step : steps) {
    const bool scaled = step->state() == detail::OptimizerStep::State::kAccumulating;
    step->open();
    for (auto& group : step->optimizer().param_groups()) {
      for (at::Tensor& p : group.params()) {
        if (!covered.insert(p.unsafeGetTensorImpl()).second) continue;
        const at::ScalarType grad_dtype = weights.is_master(p) ? at::kFloat : p.scalar_type();
        slots.push_back({p, std::exchange(p.mutable_grad(), at::Tensor()), grad_dtype, scaled});
      }
    }
  }
  for (const auto& e : weights.entries()) {
    if (e.is_buffer || !weights.is_master(e.tensor) || covered.count(e.tensor.unsafeGetTensorImpl())) continue;
    held.emplace_back(e.tensor, std::exchange(e.tensor.mutable_grad(), at::Tensor()));
  }
  if (detail::ShardedMasters* sharded = context->sharded()) {
    // ZeRO-2 reduces in every guard, delay_unscale too: the pieces
    // accumulate the averages, so no rank keeps whole gradients between
    // micro-batches. ZeRO-1 (shard_gradients=false) keeps each rank's whole
    // sum until the accumulation's last guard (hold_micro_batch).
    if (!options.delay_unscale || context->reducer()->config().shard_gradients) {
      std::vector<std::vector<detail::ReduceBucket>*> buckets;
      for (detail::OptimizerStep* step : steps) buckets.push_back(&sharded->of(step->optimizer())->buckets());
      reduction = context->reducer()->start_sharded(buckets);
    }
  } else if (detail::GradientReducer* reducer = context->reducer(); reducer && !options.delay_unscale) {
    reduction = reducer->start(slots);  // delay_unscale: DDP's no_sync, the last guard reduces
  }
  if (const auto& root = loss.grad_fn()) loss_graph = root->sequence_nr();
  const at::Tensor fp32_loss = loss.to(at::kFloat);
  scaled_loss = passthrough ? fp32_loss
                            : fp32_loss * context->scaler(options.loss_id)
                                              .scale_tensor(loss.device())
                                              .reshape(loss.sizes());
  if (context->provenance() && !passthrough) {
    trace = detail::ProvenanceTrace::watch(scaled_loss, context->parameter_names(), context->forward_log());
  } else if (context->forward_log() != nullptr) {
    context->forward_log()->clear();  // a scale of 1 never skips: nothing to explain
  }
}

// A guard captured in a CUDA graph runs again on every replay without the
// host: the scale must already be on the device, and no optimizer may need
// the verdict on the host.
void scale_loss::State::check_capturable(c10::Device device) const {
  const LossScaler& scaler = context->scaler(options.loss_id);
  TORCH_CHECK(scaler.device() == device, "amp: this scale_loss guard is being captured in a CUDA "
              "graph before loss scaler ", options.loss_id, " has been used on ", device, ". Run "
              "warm-up iterations (forward, scale_loss, step) before capturing.");
  TORCH_CHECK(!context->reducer(), "amp: this scale_loss guard is being captured in a CUDA graph, "
              "but with Options::data_parallel its gradients are averaged by hooks and "
              "collectives the host drives; capture without data_parallel.");
  for (const detail::OptimizerStep* step : steps) {
    TORCH_CHECK(!scaler.dynamic() || step->fused(), "amp: this scale_loss guard is being captured "
                "in a CUDA graph, but one of its optimizers is LibTorch's own: its step needs the "
                "overflow verdict on the host, which a capture cannot read. Use "
                "amp::optim::FusedAdam, FusedAdamW or FusedSGD, which skip on the device.");
  }
}

void scale_loss::State::unscale_gradients() {
  at::Tensor agreed;  // the ranks' overflow, known without a collective
  if (reduction) {
    reduction->finish();
    agreed = reduction->agreed_non_finite();
    reduction.reset();
  }
  detail::UnscalePlan plan(slots);
  internal::LossScaling& scaler = context->scaler(options.loss_id);
  const bool unscaling = !options.delay_unscale && !passthrough;
  at::Tensor found_inf;
  if (unscaling) found_inf = at::zeros({1}, scaler.scale_tensor(scaled_loss.device()).options());
  plan.run(unscaling ? &scaler : nullptr, found_inf);
  if (detail::TelemetryRecorder* telemetry = context->telemetry(); telemetry && !options.delay_unscale) {
    std::vector<torch::optim::Optimizer*> optimizers;
    for (detail::OptimizerStep* step : steps) optimizers.push_back(&step->optimizer());
    telemetry->record(options.loss_id, scaler.scale_tensor(scaled_loss.device()), optimizers);
  }
  if (!unscaling || !scaler.dynamic()) return;  // a static scale never skips
  if (agreed.defined()) {
    found_inf.copy_(at::maximum(found_inf, agreed));  // this rank's pieces are a part of the sums
  } else {
    context->reduce_overflow(found_inf);
  }
  verdict = std::make_shared<detail::OverflowVerdict>();
  verdict->snapshot = scaler.update(found_inf);
  verdict->loss_id = options.loss_id;
  verdict->context = context;
  if (trace) {
    std::vector<at::Tensor> params, grads;
    for (const detail::GradSlot& s : slots) {
      params.push_back(s.param);
      grads.push_back(s.param.grad());
    }
    trace->record_gradients(params, grads);
    verdict->trace = std::move(trace);
  }
}

void scale_loss::State::check_kept_gradients() {
  if (!verdict) return;  // nothing can skip (static scale)
  std::vector<at::Tensor> kept;
  for (const detail::GradSlot& s : slots) {
    if (s.aside.defined()) kept.push_back(s.aside);
  }
  at::Tensor flag = verdict->snapshot.narrow(0, 0, 1);
  at::Tensor seen = at::zeros({1}, flag.options());
  detail::non_finite_check_and_unscale(kept, seen, at::ones({1}, flag.options()));  // x * 1: a check only
  flag.copy_(at::maximum(flag, seen));
}

void scale_loss::State::commit() {
  for (auto& [param, aside] : held) param.mutable_grad() = std::move(aside);
  // LibTorch's optimizers step on whatever gradients they find: the host
  // must know the verdict now. amp's fused ones take it on the device.
  bool host_reads = false;
  for (const detail::OptimizerStep* step : steps) host_reads = host_reads || !step->fused();
  std::exception_ptr error;
  if (verdict && host_reads) {
    bool overflow = true;
    try {
      overflow = detail::read_verdicts({verdict});
    } catch (...) {  // an overflow at the floor with AtFloor::kRaise
      error = std::current_exception();
    }
    for (detail::OptimizerStep* step : steps) {
      overflow ? step->skip(detail::report_of({verdict})) : step->record_clean(loss_graph);
    }
  }
  for (detail::OptimizerStep* step : steps) {
    step->commit(host_reads ? nullptr : verdict, options.delay_unscale, options.loss_id);
  }
  if (detail::ShardedMasters* sharded = context->sharded()) {
    const bool holds = options.delay_unscale && !context->reducer()->config().shard_gradients;
    for (detail::OptimizerStep* step : steps) {
      detail::ShardedOptimizer& s = *sharded->of(step->optimizer());
      if (holds) {
        s.hold_micro_batch();
      } else if (!options.delay_unscale) {
        s.end_accumulation();
        s.mark_stale();
      }
    }
    sharded->clear_member_gradients();
  }
  stage = Stage::kFinished;
  context->weights().finish_backward();
  clear_cast_cache();
  if (error) std::rethrow_exception(error);
}

void scale_loss::State::unwind() noexcept {
  reduction.reset();
  for (detail::GradSlot& s : slots) s.param.mutable_grad() = s.aside;
  for (auto& [param, aside] : held) param.mutable_grad() = aside;
  if (scaler_before) context->scaler(options.loss_id).restore(*scaler_before);
  for (detail::OptimizerStep* step : steps) step->unwind();
  verdict.reset();
  if (detail::ShardedMasters* sharded = context->sharded()) sharded->clear_member_gradients();
  stage = Stage::kFinished;
  context->weights().finish_backward();
  clear_cast_cache();
}

scale_loss::scale_loss(const at::Tensor& loss, OptimizerRef optimizer, ScaleLossOptions options)
    : scale_loss(loss, std::vector<OptimizerRef>{optimizer}, options, 0) {}

scale_loss::scale_loss(const at::Tensor& loss, std::initializer_list<OptimizerRef> optimizers,
                       ScaleLossOptions options)
    : scale_loss(loss, std::vector<OptimizerRef>(optimizers), options, 0) {}

scale_loss::scale_loss(const at::Tensor& loss, std::vector<OptimizerRef> optimizers,
                       ScaleLossOptions options, int)
    : state_(std::make_unique<State>(loss, optimizers, options)) {}

scale_loss::~scale_loss() {
  detail::refresh_tracing();  // once an iteration: whether the next forward's casts open profiler ranges
  if (state_->stage == State::Stage::kFinished) return;
  if (std::uncaught_exceptions() > state_->uncaught_at_entry) {
    state_->unwind();
    return;
  }
  try {
    finish();
  } catch (...) {
    state_->context->defer_error(std::current_exception());
  }
}

const at::Tensor& scale_loss::scaled_loss() const { return state_->scaled_loss; }

void scale_loss::backward(std::optional<bool> retain_graph, bool create_graph) {
  state_->scaled_loss.backward({}, retain_graph, create_graph);
}

at::Tensor scale_loss::loss_scale() const {
  return state_->context->scaler(state_->options.loss_id).scale_tensor(state_->scaled_loss.device());
}

void scale_loss::unscale() {
  State& s = *state_;
  TORCH_CHECK(s.stage == State::Stage::kOpen, "amp: unscale() was already called for this "
              "scale_loss, or the guard has finished; gradients are unscaled at most once per "
              "backward.");
  TORCH_CHECK(!s.options.delay_unscale, "amp: unscale() contradicts delay_unscale=true; unscale "
              "in the last micro-batch's guard (delay_unscale=false).");
  s.scaler_before = s.context->scaler(s.options.loss_id).state();
  s.unscale_gradients();
  if (s.steps.size() > 1) s.check_kept_gradients();
  s.stage = State::Stage::kUnscaled;
}

void scale_loss::finish() {
  State& s = *state_;
  TORCH_CHECK(s.stage != State::Stage::kFinished, "amp: finish() was already called for this "
              "scale_loss.");
  try {
    if (s.stage == State::Stage::kOpen) s.unscale_gradients();
  } catch (...) {
    s.unwind();
    throw;
  }
  s.commit();
}

}  // namespace amp
