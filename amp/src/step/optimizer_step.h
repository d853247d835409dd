// SPDX-License-Identifier: BSD-3-Clause
// Private: one optimizer's side of the training step - the state machine
// that scale_loss guards and amp's fused step() drive. Every transition is
// in optimizer_step.cpp; errors name the state.
//
//   state          meaning                                   leaves by
//   -------------  ----------------------------------------  --------------------------------
//   kReady         gradients, if any, hold true values;      a guard opening -> kInGuard
//                  step() may run                            (not while a step applied in
//                                                            backward awaits its step())
//   kInGuard       a scale_loss guard over it is open        commit(GuardOutcome) -> kReady or
//                                                            kAccumulating (delay_unscale);
//                                                            unwind -> the state before
//   kAccumulating  delay_unscale: amp holds the gradients,   a guard for the same loss
//                  scaled by loss `scaled_by`, away from     opening -> kInGuard
//                  the optimizer (its step() does nothing)
//
// Overflow verdicts. A guard over LibTorch's optimizers reads its verdict on
// the host when it ends; after an overflow (GuardOutcome::kOverflow) the
// optimizer loses its gradients, so its own step() changes nothing. A guard
// whose optimizers are all amp's fused ones (fused.h) hands over the device
// verdict instead (kOnDevice), which is queued; their step() hands the
// combined flag to the kernels and leaves a pending step - the one queue - until the verdicts reach the
// host (settle): then the step is counted or, if skipped, the state it
// created is dropped and gradients it left are discarded (a loop that never
// zeroes must not carry inf/NaN into the next step).
//
// CUDA graphs (graph_capture.h). A fused step captured in a graph runs again
// on every replay without the host: while capturing, amp neither queries
// nor waits, the captured step leaves nothing pending, and replays count
// on the device (replay_tally_), read when the host asks (catch_up).
// Capturing needs warm-up steps first (state, device step counts and the
// tally exist) and amp's fused optimizers under a dynamic scale; otherwise
// the capture stops with an error that says which.
//
// amp cannot see LibTorch's own step(), so an overflow ends what the
// optimizer accumulated: later guards in the same iteration (over losses
// recorded before the overflow) drop theirs too; a guard over a loss
// recorded after it starts afresh. In kAccumulating the optimizer sees
// no gradients, so a step() taken then changes nothing instead of applying
// gradients multiplied by the loss scale.
#pragma once

#include "optim/held_gradients.h"
#include "step/overflow_verdict.h"

#include <amp/fused.h>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <deque>
#include <memory>
#include <optional>
#include <vector>

namespace amp::optim::internal {
struct FusedAttempt;
}

namespace amp::detail {

// How a scale_loss guard over an optimizer ended well.
struct GuardOutcome {
  enum class Verdict : uint8_t {
    kNone,      // nothing can skip (a static scale, or delay_unscale)
    kClean,     // read on the host: no overflow
    kOverflow,  // read on the host: the gradients are dropped
    kOnDevice,  // amp's fused optimizers take `device_verdict` on the device
  };
  Verdict verdict = Verdict::kNone;
  std::shared_ptr<OverflowVerdict> device_verdict;  // kOnDevice
  std::shared_ptr<const OverflowReport> report;     // kOverflow (null: provenance off)
  // The loss's graph, numbered by autograd up to this (its root node's
  // sequence number): a loss recorded before an overflow of the same
  // iteration stays skipped.
  uint64_t loss_graph = 0;
  bool delay_unscale = false;
  int loss_id = 0;
  // Properties::step_in_backward: backward applied the step; the
  // optimizer's step() only ends the iteration.
  bool stepped_in_backward = false;
};

class OptimizerStep {
 public:
  enum class State : uint8_t { kReady, kInGuard, kAccumulating };

  OptimizerStep(torch::optim::Optimizer& optimizer, optim::internal::Fused* fused);
  ~OptimizerStep();

  State state() const { return iteration_.state; }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  bool fused() const { return fused_ != nullptr; }
  optim::internal::Fused* fused_optimizer() const { return fused_; }

  // ---- scale_loss guards -------------------------------------------------
  // Throws, changing nothing, when a guard for `loss_id` cannot open now.
  void check_can_open(int loss_id, bool delay_unscale) const;
  // Learns what a guard opening now must know of pending fused steps:
  // gradients kept from a step the device skipped are discarded.
  void settle_before_guard();
  // Room in the record for every parameter's aside (before open: open and
  // set_aside cannot fail then).
  void reserve_asides();
  void open();  // kReady | kAccumulating -> kInGuard
  // The guard covers `param`: the record takes its gradient (true values)
  // or keeps the accumulation's sum it holds for it, and returns that - the
  // aside the guard's unscale adds in. Given back if the guard unwinds.
  // Each parameter once per guard (the guard's covered set).
  const at::Tensor& set_aside(const at::Tensor& param);
  // The step in backward applied `param`'s aside: an unwind gives it none.
  void release_aside(const at::Tensor& param) noexcept { iteration_.held.put(param, at::Tensor()); }
  // Every gradient the record holds (asides, an accumulation's sums).
  const HeldGradients& held() const { return iteration_.held; }
  // ZeRO-1: room for `sums` beside what commit holds (prepare), then at
  // commit each member's float32 sum of the accumulation so far, which the
  // last guard's reduction adds.
  void reserve_sums(size_t sums);
  void hold_sum(const at::Tensor& member, at::Tensor sum) noexcept;
  // The guard is ending with `outcome`: allocates what commit needs, so
  // that commit cannot fail (changes nothing else).
  void prepare(const GuardOutcome& outcome);
  // The guard ended: one outcome, applied as a whole.
  void commit(const GuardOutcome& outcome) noexcept;  // kInGuard -> kReady | kAccumulating
  void unwind() noexcept;  // kInGuard -> the state before open()

  // ---- amp's fused step() ------------------------------------------------
  struct FusedDecision {
    bool skip = false;      // decided on the host: do not step
    at::Tensor found_inf;   // defined: the kernels decide (exactly 0 or 1)
    Verdicts verdicts;      // what found_inf combines
  };
  // `rounds`: the step rounds or codes its results stochastically (O6,
  // 8-bit state). Errors: a step inside a guard or during delay_unscale
  // accumulation; an overflow at the floor with AtFloor::kRaise (the step is
  // skipped); a capture the graph could not replay. After a guard that
  // stepped in backward: decides `skip` (nothing is left).
  FusedDecision begin_fused_step(bool kernels_apply, bool rounds);
  // The kernels ran as `decision` said: with a device verdict the step is
  // pending until it reaches the host; without one it was taken.
  void end_fused_step(optim::internal::FusedAttempt attempt, FusedDecision decision);

  int64_t skipped_steps();
  bool last_step_skipped();
  // The report of the latest overflow that skipped a step (null: none, or
  // provenance off).
  std::shared_ptr<const OverflowReport> last_overflow();
  // Learns the outcome of pending fused steps whose verdicts reached the
  // host, or with `wait`, of all of them.
  void settle(bool wait);
  // Learns every outcome: all pending steps and, after a CUDA graph
  // capture, what its replays counted (host step counts included).
  void catch_up();

 private:
  struct PendingStep;
  void skip(std::shared_ptr<const OverflowReport> report);
  void record_clean(uint64_t loss_graph);
  bool holds_gradients() const;
  void hold_accumulated() noexcept;
  size_t parameter_count() const;
  void drop_gradients();
  void record_outcome(bool skipped, std::shared_ptr<const OverflowReport> report = nullptr);
  const at::Tensor* first_parameter() const;  // where the optimizer's device work runs
  bool capturing() const;
  void check_capturable(bool kernels_apply, bool rounds) const;

  // One iteration of this optimizer, from its first guard to its step, as
  // torch.amp keeps {stage, found_inf_per_device} per optimizer: what the
  // guards left for the step. Reset whole by end_iteration() - where a step
  // is taken, a step is skipped, or the program zeroed the gradients
  // without one - and nowhere in part (reset()).
  struct Iteration {
    State state = State::kReady;
    State before_guard = State::kReady;  // kInGuard: the state an unwind returns to
    bool hold_was_empty = false;         // kInGuard: nothing was held when the guard opened
    int scaled_by = 0;                   // kAccumulating: the loss whose scale the sum carries
    // The accumulated gradients, off the parameters (held_gradients.h):
    // kInGuard, the guard's asides; kAccumulating, the scaled sum (ZeRO-1:
    // the members' float32 sums), so that a step() in between changes nothing.
    HeldGradients held;
    Verdicts verdicts;                   // device verdicts the next fused step combines
    // A guard's backward applied the step (step_in_backward): step() only
    // ends the iteration.
    bool stepped_in_backward = false;

    // Every field back to its value above. The hold and the verdicts keep
    // their room: a new hash table allocates, and this runs every step.
    void reset() noexcept {
      state = before_guard = State::kReady;
      hold_was_empty = false;
      scaled_by = 0;
      held.clear();
      verdicts.clear();
      stepped_in_backward = false;
    }
  };
  void end_iteration() noexcept { iteration_.reset(); }

  torch::optim::Optimizer* optimizer_;
  optim::internal::Fused* fused_;
  Iteration iteration_;
  // What outlives an iteration: steps whose verdicts are still on the
  // device, the counts, the latest report, and where the last overflow's
  // iteration ended.
  std::deque<PendingStep> pending_;       // fused steps the device decided, oldest first
  int64_t skipped_steps_ = 0;
  bool last_step_skipped_ = false;
  std::shared_ptr<const OverflowReport> last_overflow_;
  // After an overflow dropped the gradients: autograd's next sequence number
  // then. A later guard's loss recorded before it belongs to the same
  // iteration (Apex's losses computed first, then a guard each), so the
  // step stays skipped.
  uint64_t skipped_before_graph_ = 0;
  // CUDA parameters: [replayed steps, of them skipped, last step skipped]
  // on the device, made by the first fused step so it exists before a
  // capture; written by replays and, once captured_, by every fused step.
  at::Tensor replay_tally_;
  bool captured_ = false;
};

const char* to_string(OptimizerStep::State state);

}  // namespace amp::detail
