// SPDX-License-Identifier: BSD-3-Clause
#include <amp/scale_loss.h>

#include <amp/cast_cache.h>
#include <amp/casting_scope.h>

#include "autograd/backward_roots.h"
#include "optim/non_finite_check.h"
#include "step/guard.h"
#include "support/graph_capture.h"
#include "support/trace_range.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>

#include <exception>
#include <unordered_set>
#include <utility>
#include <vector>

namespace amp {
namespace detail {

Guard::Guard(const at::Tensor& loss, c10::ArrayRef<internal::OptimizerRef> optimizers, ScaleLossOptions guard_options)
    : session_(require_step_session("amp::scale_loss")), options_(guard_options) {
  session_->rethrow_deferred_error();
  session_->weights().take_model_zeroing();  // the program's zero_grad, done before this guard
  TORCH_CHECK(loss.defined(), "amp: scale_loss got an undefined loss tensor.");
  TORCH_CHECK(loss.is_floating_point(), "amp: scale_loss needs a floating-point loss, got ",
              loss.scalar_type());
  TORCH_CHECK(loss.numel() == 1, "amp: scale_loss needs a scalar loss (one element), got shape ",
              loss.sizes(), "; reduce it first, e.g. loss.mean().");
  TORCH_CHECK(options_.loss_id >= 0 && options_.loss_id < session_->num_losses(), "amp: loss_id ",
              options_.loss_id, " is out of range: amp was initialized with num_losses=",
              session_->num_losses(), " (loss_id 0..", session_->num_losses() - 1, ").");
  TORCH_CHECK(!optimizers.empty(), "amp: scale_loss needs the optimizer(s) that will step "
              "these gradients.");
  steps_.reserve(optimizers.size());
  for (const internal::OptimizerRef& ref : optimizers) {  // validate everything before changing anything
    OptimizerStep& step = session_->require_step(ref.get(), "amp::scale_loss");
    TORCH_CHECK(std::find(steps_.begin(), steps_.end(), &step) == steps_.end(),
                "amp: scale_loss got the same optimizer twice.");
    step.check_can_open(options_.loss_id, options_.delay_unscale);
    steps_.push_back(&step);
  }
  ModelWeights& weights = session_->weights();
  const LossScale& configured = session_->properties().loss_scale;
  passthrough_ = !configured.dynamic && configured.value == 1.0 && weights.mode() != ModelWeights::Mode::kMasters;
  capturing_ = detail::capturing(loss.device());
  try {
    if (!passthrough_ && capturing_) check_capturable(loss.device());
    for (const StepParticipant* p : session_->participants()) p->check_open(*this);
  } catch (...) {
    if (capturing_) clear_cast_cache();  // casts the capture recorded but never ran
    throw;
  }
  weights.prepare_backward();
  for (OptimizerStep* step : steps_) {
    step->settle_before_guard();
    step->reserve_asides();
  }

  // Everything is checked; from here on the guard changes state.
  size_t params = 0;
  for (OptimizerStep* step : steps_) {
    for (const auto& group : step->optimizer().param_groups()) params += group.params().size();
  }
  slots_.reserve(params);
  // Each parameter once, however many groups or optimizers list it. The set
  // keeps its room from guard to guard: no allocation a step.
  thread_local ska::flat_hash_set<const c10::TensorImpl*> covered;
  covered.clear();
  covered.reserve(params);
  for (OptimizerStep* step : steps_) {
    const bool scaled = step->state() == OptimizerStep::State::kAccumulating;
    step->open();
    for (auto& group : step->optimizer().param_groups()) {
      for (at::Tensor& p : group.params()) {
        if (!covered.insert(p.unsafeGetTensorImpl()).second) continue;
        const at::ScalarType grad_dtype = weights.is_master(p) ? at::kFloat : p.scalar_type();
        slots_.push_back({p, step->set_aside(p), grad_dtype, scaled});
      }
    }
  }
  for (const auto& e : weights.entries()) {
    if (e.is_buffer || !weights.is_master(e.tensor) || covered.count(e.tensor.unsafeGetTensorImpl())) continue;
    held_.take(e.tensor);
  }
  try {
    if (const auto& root = loss.grad_fn()) loss_graph_ = root->sequence_nr();
    // A float32 loss as it is: `to` is a dispatched op even when it returns its input.
    const at::Tensor fp32_loss = loss.scalar_type() == at::kFloat ? loss : loss.to(at::kFloat);
    // The scale in the loss's shape (a loss has one element), a view made
    // without an op: the scaled loss has the loss's shape.
    scaled_loss_ = passthrough_ ? fp32_loss
                                : fp32_loss * scaler().scale_as(loss.device(), loss.sizes());
    for (StepParticipant* p : session_->participants()) {
      if (auto part = p->open(*this)) parts_.push_back(std::move(part));
    }
  } catch (...) {
    unwind();
    throw;
  }
}

// A guard captured in a CUDA graph runs again on every replay without the
// host: the scale must already be on the device, and no optimizer may need
// the verdict on the host.
void Guard::check_capturable(c10::Device device) const {
  const LossScaler& scaler = session_->scaler(options_.loss_id);
  TORCH_CHECK(scaler.device() == device, "amp: this scale_loss guard is being captured in a CUDA "
              "graph before loss scaler ", options_.loss_id, " has been used on ", device, ". Run "
              "warm-up iterations (forward, scale_loss, step) before capturing_.");
  for (const OptimizerStep* step : steps_) {
    TORCH_CHECK(!scaler.dynamic() || step->fused(), "amp: this scale_loss guard is being captured "
                "in a CUDA graph, but one of its optimizers is LibTorch's own: its step needs the "
                "overflow verdict on the host, which a capture cannot read. Use "
                "amp::optim::FusedAdam, FusedAdamW or FusedSGD, which skip on the device.");
  }
}

void Guard::unscale() {
  for (const auto& part : parts_) part->before_unscale(*this);
  // Backward is over: O2/O5's weights rest in float32 and free their
  // low-precision copies before the float32 gradients are made, so the two
  // are never held together.
  session_->weights().finish_backward();
  UnscalePlan plan(slots_);
  const bool unscaling = !options_.delay_unscale && !passthrough_;
  at::Tensor verdict, found_inf;
  if (unscaling) {
    verdict = scaler().new_verdict(scaled_loss_.device());
    found_inf = internal::LossScaling::overflow_flag(verdict);
  }
  if (unscaling) {
    plan.run([&](const std::vector<at::Tensor>& scaled) { scaler().unscale(scaled, found_inf); });
  } else {
    plan.run({});
  }
  for (const auto& part : parts_) part->after_unscale(*this);
  if (!unscaling || !scaler().dynamic()) return;  // a static scale never skips
  for (const auto& part : parts_) part->agree_overflow(*this, found_inf);
  // To unwind the update if a participant then fails to prepare (without
  // participants nothing after it can fail, and a step saves the copies).
  if (!scaler_before_ && !parts_.empty()) scaler_before_ = scaler().state();
  verdict_ = std::make_shared<OverflowVerdict>();
  scaler().update(verdict, found_inf);
  verdict_->snapshot = verdict;
  verdict_->loss_id = options_.loss_id;
  verdict_->session = session_;
  for (const auto& part : parts_) part->judged(*this, *verdict_);
}

void Guard::unscale_by_program() {
  scaler_before_ = scaler().state();  // the program may throw before the guard ends
  unscale();
  if (steps_.size() > 1) check_kept_gradients();
  stage_ = Stage::kUnscaled;
}

void Guard::check_kept_gradients() {
  if (!verdict_) return;  // nothing can skip (static scale)
  std::vector<at::Tensor> kept;
  for (const GradSlot& s : slots_) {
    if (s.aside.defined()) kept.push_back(s.aside);
  }
  at::Tensor flag = verdict_->snapshot.narrow(0, 0, 1);
  at::Tensor seen = at::zeros({1}, flag.options());
  non_finite_check_and_unscale(kept, seen, at::ones({1}, flag.options()));  // x * 1: a check only
  flag.copy_(at::maximum(flag, seen));
}

void Guard::gradients_final(const std::vector<at::Tensor>& params) {
  for (const auto& part : parts_) part->gradients_final(*this, params);
}

void Guard::commit() {
  // LibTorch's optimizers step on whatever gradients they find: the host
  // must know the verdict now. amp's fused ones take it on the device.
  bool host_reads = false;
  for (const OptimizerStep* step : steps_) host_reads = host_reads || !step->fused();
  GuardOutcome outcome;
  outcome.loss_graph = loss_graph_;
  outcome.delay_unscale = options_.delay_unscale;
  outcome.loss_id = options_.loss_id;
  outcome.stepped_in_backward = session_->properties().step_in_backward;
  std::exception_ptr error;
  if (verdict_ && host_reads) {
    bool overflow = true;
    try {
      overflow = read_verdicts({verdict_});
    } catch (...) {  // an overflow at the floor with DynamicScaling::AtFloor::kRaise
      error = std::current_exception();
    }
    outcome.verdict = overflow ? GuardOutcome::Verdict::kOverflow : GuardOutcome::Verdict::kClean;
    if (overflow) outcome.report = report_of({verdict_});
  } else if (verdict_) {
    outcome.verdict = GuardOutcome::Verdict::kOnDevice;
    outcome.device_verdict = verdict_;
  }
  // What can fail runs first, and a failure there unwinds the whole guard;
  // from the commits on nothing fails, so the optimizers and participants
  // commit together or not at all.
  try {
    for (OptimizerStep* step : steps_) step->prepare(outcome);
    for (const auto& part : parts_) part->prepare(*this);
  } catch (...) {
    unwind();
    throw;
  }
  held_.give_back();
  for (OptimizerStep* step : steps_) step->commit(outcome);
  for (const auto& part : parts_) part->commit(*this);
  stage_ = Stage::kFinished;  // the weights rested at the unscale, which always comes first
  clear_cast_cache();
  if (error) std::rethrow_exception(error);
}

void Guard::unwind() noexcept {
  for (auto part = parts_.rbegin(); part != parts_.rend(); ++part) (*part)->unwind(*this);
  parts_.clear();
  held_.give_back();
  if (scaler_before_) scaler().restore(*scaler_before_);
  for (OptimizerStep* step : steps_) step->unwind();
  verdict_.reset();
  stage_ = Stage::kFinished;
  session_->weights().finish_backward();
  clear_cast_cache();
}

}  // namespace detail

// The guard's transaction (step/guard.h).
class scale_loss::State final : public detail::Guard {
  using Guard::Guard;
};

scale_loss::scale_loss(const at::Tensor& loss, internal::OptimizerRef optimizer, ScaleLossOptions options)
    : scale_loss(loss, c10::ArrayRef<internal::OptimizerRef>(optimizer), options, 0) {}

scale_loss::scale_loss(const at::Tensor& loss, std::initializer_list<internal::OptimizerRef> optimizers,
                       ScaleLossOptions options)
    : scale_loss(loss, c10::ArrayRef<internal::OptimizerRef>(optimizers), options, 0) {}

scale_loss::scale_loss(const at::Tensor& loss, c10::ArrayRef<internal::OptimizerRef> optimizers,
                       ScaleLossOptions options, int)
    : state_(std::make_unique<State>(loss, optimizers, options)) {}

scale_loss::~scale_loss() {
  detail::refresh_tracing();  // once an iteration: whether the next forward's casts open profiler ranges
  if (state_->stage() == State::Stage::kFinished) return;
  if (state_->exception_in_scope()) {
    state_->unwind();
    return;
  }
  try {
    finish();
  } catch (...) {
    state_->session().defer_error(std::current_exception());
  }
}

const at::Tensor& scale_loss::scaled_loss() const { return state_->scaled_loss(); }

void scale_loss::backward(std::optional<bool> retain_graph, bool create_graph) {
  if (retain_graph.value_or(create_graph)) state_->keep_graph();
  const detail::BackwardFromRoot root(state_->scaled_loss().grad_fn());  // for nodes that must see the whole graph
  state_->scaled_loss().backward({}, retain_graph, create_graph);
}

at::Tensor scale_loss::loss_scale() const {
  return state_->session().scaler(state_->options().loss_id).scale_tensor(state_->scaled_loss().device());
}

void scale_loss::unscale() {
  State& s = *state_;
  TORCH_CHECK(s.stage() == State::Stage::kOpen, "amp: unscale() was already called for this "
              "scale_loss, or the guard has finished; gradients are unscaled at most once per "
              "backward.");
  TORCH_CHECK(!s.options().delay_unscale, "amp: unscale() contradicts delay_unscale=true; unscale "
              "in the last micro-batch's guard (delay_unscale=false).");
  TORCH_CHECK(!s.session().properties().step_in_backward, "amp: unscale() hands the program the unscaled "
              "gradients, but step_in_backward applied each of them during backward and freed it. Read or "
              "clip gradients without step_in_backward.");
  s.unscale_by_program();
}

void scale_loss::finish() {
  State& s = *state_;
  TORCH_CHECK(s.stage() != State::Stage::kFinished, "amp: finish() was already called for this "
              "scale_loss.");
  try {
    if (s.stage() == State::Stage::kOpen) s.unscale();
  } catch (...) {
    s.unwind();
    throw;
  }
  s.commit();
}

}  // namespace amp
