// SPDX-License-Identifier: BSD-3-Clause
#include "step/optimizer_step.h"

#include "optim/fused_stepping.h"
#include "support/graph_capture.h"
#include "support/host_read.h"

#include <ATen/SequenceNumber.h>
#include <c10/util/Exception.h>

namespace amp::detail {

struct OptimizerStep::PendingStep {
  DeferredVerdicts verdicts;
  optim::internal::FusedAttempt attempt;
  bool gradients_live = true;  // the gradients are still this step's
};

const char* to_string(OptimizerStep::State state) {
  switch (state) {
    case OptimizerStep::State::kReady:
      return "ready";
    case OptimizerStep::State::kInGuard:
      return "inside a live scale_loss guard";
    case OptimizerStep::State::kAccumulating:
      return "accumulating scaled gradients (delay_unscale)";
  }
  return "?";
}

OptimizerStep::OptimizerStep(torch::optim::Optimizer& optimizer, optim::internal::Fused* fused)
    : optimizer_(&optimizer), fused_(fused) {}

OptimizerStep::~OptimizerStep() = default;

bool OptimizerStep::holds_gradients() const {
  for (const auto& group : optimizer_->param_groups()) {
    for (const auto& p : group.params()) {
      if (p.grad().defined()) return true;
    }
  }
  return false;
}

const at::Tensor* OptimizerStep::first_parameter() const {
  for (const auto& group : optimizer_->param_groups()) {
    if (!group.params().empty()) return &group.params().front();
  }
  return nullptr;
}

bool OptimizerStep::capturing() const {
  const at::Tensor* p = first_parameter();
  return p != nullptr && detail::capturing(p->device());
}

void OptimizerStep::drop_gradients() {
  for (auto& group : optimizer_->param_groups()) {
    for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
  }
}

// ---- scale_loss guards ------------------------------------------------------

void OptimizerStep::check_can_open(int loss_id, bool delay_unscale) const {
  const Iteration& it = iteration_;
  TORCH_CHECK(it.state != State::kInGuard, "amp: the optimizer is ", to_string(it.state), "; end that "
              "guard's scope before starting another over the same optimizer.");
  TORCH_CHECK(!it.stepped_in_backward, "amp: step_in_backward applied this optimizer's step during the last "
              "scale_loss guard's backward, and its step() has not been called since. Call optimizer.step() "
              "(it applies nothing more) to end the iteration before the next guard over it: two guards before "
              "one step() would step the parameters twice. For several losses in one step, add them up and "
              "run one guard.");
  if (it.state == State::kAccumulating) {
    TORCH_CHECK(it.scaled_by == loss_id, "amp: the optimizer is ", to_string(it.state), " from "
                "loss_id ", it.scaled_by, "; finish it (delay_unscale=false) with the same loss_id "
                "before scaling loss ", loss_id, ".");
  }
  TORCH_CHECK(!delay_unscale || it.state == State::kAccumulating || !holds_gradients(),
              "amp: delay_unscale=true while the optimizer's gradients hold unscaled values; "
              "call zero_grad() before the first micro-batch of an accumulation.");
}

void OptimizerStep::settle_before_guard() {
  // Gradients kept from a pending step are discarded if it was skipped, so
  // its outcome is needed now; without any, the guard need not wait, and a
  // verdict no longer judges anything: zero_grad ended the iteration
  // without a step. (An accumulation holds its sum off the parameters.)
  const bool kept = holds_gradients();
  if (!kept) {
    for (PendingStep& p : pending_) p.gradients_live = false;
    if (iteration_.state == State::kReady) end_iteration();
  }
  settle(/*wait=*/kept);
}

size_t OptimizerStep::parameter_count() const {
  size_t count = 0;
  for (const auto& group : optimizer_->param_groups()) count += group.params().size();
  return count;
}

void OptimizerStep::reserve_asides() { iteration_.held.reserve(parameter_count()); }

void OptimizerStep::open() {
  Iteration& it = iteration_;
  TORCH_INTERNAL_ASSERT(it.state != State::kInGuard, "amp: a guard opened over an optimizer that is ",
                        to_string(it.state));
  it.before_guard = it.state;
  it.state = State::kInGuard;
  it.hold_was_empty = it.held.empty();
}

const at::Tensor& OptimizerStep::set_aside(const at::Tensor& param) {
  // The guard sets each parameter aside once: over an empty hold there is
  // nothing to look up. Room reserved by reserve_asides().
  Iteration& it = iteration_;
  return it.hold_was_empty ? it.held.take_new(param) : it.held.take(param);
}

// kAccumulating keeps the scaled sum away from the optimizer, so a step()
// taken before the guard that ends the accumulation changes nothing.
void OptimizerStep::hold_accumulated() noexcept {
  for (auto& group : optimizer_->param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) iteration_.held.take(p);  // room reserved by prepare()
    }
  }
}

void OptimizerStep::reserve_sums(size_t sums) { iteration_.held.reserve(parameter_count() + sums); }

void OptimizerStep::hold_sum(const at::Tensor& member, at::Tensor sum) noexcept {
  iteration_.held.put(member, std::move(sum));  // room reserved by reserve_sums()
}

void OptimizerStep::prepare(const GuardOutcome& outcome) {
  Iteration& it = iteration_;
  TORCH_INTERNAL_ASSERT(it.state == State::kInGuard, "amp: a guard committed an optimizer that is ",
                        to_string(it.state));
  if (outcome.verdict == GuardOutcome::Verdict::kOnDevice) it.verdicts.reserve(it.verdicts.size() + 1);
  if (outcome.delay_unscale) it.held.reserve(parameter_count());
}

void OptimizerStep::commit(const GuardOutcome& outcome) noexcept {
  iteration_.held.clear();  // the unscale summed the asides into the new gradients
  switch (outcome.verdict) {
    case GuardOutcome::Verdict::kNone:
      break;
    case GuardOutcome::Verdict::kClean:
      record_clean(outcome.loss_graph);
      break;
    case GuardOutcome::Verdict::kOverflow:
      skip(outcome.report);
      break;
    case GuardOutcome::Verdict::kOnDevice:
      iteration_.verdicts.push_back(outcome.device_verdict);
      break;
  }
  Iteration& it = iteration_;
  it.state = outcome.delay_unscale ? State::kAccumulating : State::kReady;
  it.stepped_in_backward = outcome.stepped_in_backward;
  it.scaled_by = outcome.loss_id;
  if (outcome.delay_unscale) hold_accumulated();
}

void OptimizerStep::skip(std::shared_ptr<const OverflowReport> report) {
  drop_gradients();
  end_iteration();  // verdicts of a step that will not run
  record_outcome(/*skipped=*/true, std::move(report));
  skipped_before_graph_ = at::sequence_number::peek();
}

void OptimizerStep::record_clean(uint64_t loss_graph) {
  if (loss_graph < skipped_before_graph_) {  // the overflowed iteration goes on: still skipped
    drop_gradients();
    return;
  }
  record_outcome(/*skipped=*/false);
}

void OptimizerStep::unwind() noexcept {
  Iteration& it = iteration_;
  if (it.state != State::kInGuard) return;  // (never opened: nothing to undo)
  it.state = it.before_guard;
  if (it.state == State::kAccumulating) {
    drop_gradients();  // this backward's; the sum stays held
  } else {
    it.held.give_back();
  }
}

void OptimizerStep::record_outcome(bool skipped, std::shared_ptr<const OverflowReport> report) {
  last_step_skipped_ = skipped;
  if (skipped) ++skipped_steps_;
  if (report) last_overflow_ = std::move(report);
}

// ---- amp's fused step() -------------------------------------------------------

OptimizerStep::FusedDecision OptimizerStep::begin_fused_step(bool kernels_apply, bool rounds) {
  const State state = iteration_.state;
  TORCH_CHECK(state == State::kReady, "amp: step() while the optimizer is ", to_string(state),
              state == State::kInGuard
                  ? "; end the guard's scope (it unscales the gradients) before stepping."
                  : "; the last micro-batch's guard must use delay_unscale=false so the "
                    "accumulated gradients are unscaled and checked.");
  if (iteration_.stepped_in_backward) {
    end_iteration();
    record_outcome(/*skipped=*/false);
    FusedDecision applied;  // backward applied it
    applied.skip = true;
    return applied;
  }
  // A pending step that created state must be known taken before that
  // state is used again (on a GPU: once, after the first step).
  bool created = false;
  for (const PendingStep& p : pending_) created = created || !p.attempt.created.empty();
  settle(/*wait=*/created);
  if (capturing()) {
    try {
      check_capturable(kernels_apply, rounds);
    } catch (...) {
      end_iteration();  // verdicts of the failed capture: never computed
      throw;
    }
  }
  if (const at::Tensor* p = first_parameter(); !replay_tally_.defined() && p && p->is_cuda()) {
    replay_tally_ = at::zeros({3}, p->options().dtype(at::kFloat));
  }
  // The step ends the iteration: what its guards left is taken here.
  Verdicts verdicts = std::move(iteration_.verdicts);
  end_iteration();
  FusedDecision decision;
  if (verdicts.empty() || !holds_gradients()) return decision;
  bool unread = true;
  for (const auto& v : verdicts) unread = unread && !v->resolved;
  if (kernels_apply && unread) {
    decision.found_inf = combined_found_inf(verdicts);
    decision.verdicts = std::move(verdicts);
    return decision;
  }
  try {
    decision.skip = read_verdicts(verdicts);
  } catch (...) {  // an overflow at the floor with DynamicScaling::AtFloor::kRaise: skipped
    drop_gradients();
    record_outcome(true);
    throw;
  }
  if (decision.skip) drop_gradients();
  record_outcome(decision.skip, report_of(verdicts));
  if (captured_) replay_tally_.narrow(0, 2, 1).fill_(decision.skip ? 1.0 : 0.0);
  return decision;
}

void OptimizerStep::check_capturable(bool kernels_apply, bool rounds) const {
  TORCH_CHECK(kernels_apply, "amp: step() is being captured in a CUDA graph, but the fused kernels "
              "cannot step these parameters (each gradient must be dense, contiguous and of its "
              "parameter's dtype, all on one device), and LibTorch's own step needs the overflow "
              "verdict on the host, which a capture cannot read.");
  // The rounding's streams are numbered by the host's step count, which a
  // replay does not advance: each replay would draw the captured step's
  // noise again, the same for a value every step - a bias, not noise.
  TORCH_CHECK(!rounds, "amp: step() is being captured in a CUDA graph, but O6's stochastic rounding and 8-bit "
              "state's coding draw fresh noise every step, which a replay cannot: every replay would round with "
              "the captured step's noise, and the rounding would be biased. Run these steps without a graph, or "
              "use O5, whose float32 masters and state need no rounding.");
  TORCH_CHECK(replay_tally_.defined() && fused_->stepping().holds_all_state(*optimizer_),
              "amp: step() is being captured in a CUDA graph before the optimizer has taken a step "
              "on every parameter: the state it would create here would be reset on every replay. "
              "Run warm-up iterations (forward, scale_loss, step) before capturing, then "
              "amp::skipped_steps(optimizer) so that their outcome is known.");
  bool unread = true;
  for (const auto& v : iteration_.verdicts) unread = unread && !v->resolved;
  TORCH_CHECK(unread, "amp: step() is being captured in a CUDA graph, but a guard's overflow "
              "verdict was already read on the host (amp::last_step_skipped or "
              "amp::skipped_steps inside the captured region); read them outside it.");
}

void OptimizerStep::end_fused_step(optim::internal::FusedAttempt attempt, FusedDecision decision) {
  const bool in_capture = capturing();
  if (in_capture || captured_) {  // the device keeps the last outcome; replays count there
    const at::Tensor skipped = decision.found_inf.defined()
                                   ? decision.found_inf.reshape({1}).to(replay_tally_.device())
                                   : at::zeros({1}, replay_tally_.options());
    replay_tally_.narrow(0, 2, 1).copy_(skipped);
    if (in_capture) {
      captured_ = true;
      replay_tally_.narrow(0, 0, 1).add_(1);
      replay_tally_.narrow(0, 1, 1).add_(skipped);
      return;
    }
  }
  if (!decision.found_inf.defined()) {  // no verdict to wait for: taken
    fused_->stepping().settle(attempt, /*skipped=*/false, optimizer_->state());
    return;
  }
  pending_.push_back({DeferredVerdicts(std::move(decision.verdicts)), std::move(attempt), true});
  settle(/*wait=*/false);
}

void OptimizerStep::settle(bool wait) {
  if (pending_.empty()) return;  // (the optimizer may be gone: amp's teardown)
  if (capturing()) {  // a query or a wait would end the capture
    TORCH_CHECK(!wait, "amp: a CUDA graph is being captured, and this "
                "optimizer's next step depends on an earlier step whose overflow verdict has not "
                "reached the host; a capture cannot wait for it. Before capturing, call "
                "amp::skipped_steps(optimizer), which waits for every pending step.");
    return;
  }
  while (!pending_.empty() && (wait || pending_.front().verdicts.ready())) {
    PendingStep step = std::move(pending_.front());
    pending_.pop_front();
    bool skipped = true;
    std::exception_ptr error;
    try {
      skipped = step.verdicts.resolve();
    } catch (...) {  // an overflow at the floor with DynamicScaling::AtFloor::kRaise: the step was skipped
      error = std::current_exception();
    }
    fused_->stepping().settle(step.attempt, skipped, optimizer_->state());
    if (skipped && step.gradients_live) drop_gradients();
    record_outcome(skipped, skipped ? step.verdicts.report() : nullptr);
    if (error) std::rethrow_exception(error);
  }
}

void OptimizerStep::catch_up() {
  settle(/*wait=*/true);
  if (!captured_) return;
  const at::Tensor tally = replay_tally_.cpu();  // one host sync
  count_host_read();
  skipped_steps_ += static_cast<int64_t>(tally[1].item<float>());
  last_step_skipped_ = tally[2].item<float>() > 0;
  replay_tally_.narrow(0, 0, 2).zero_();
  fused_->stepping().adopt_device_counts(optimizer_->state());
}

int64_t OptimizerStep::skipped_steps() {
  catch_up();
  return skipped_steps_;
}

bool OptimizerStep::last_step_skipped() {
  catch_up();
  return last_step_skipped_;
}

std::shared_ptr<const OverflowReport> OptimizerStep::last_overflow() {
  catch_up();
  return last_overflow_;
}

}  // namespace amp::detail
