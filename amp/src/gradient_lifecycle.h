// Private: the gradient lifecycle of one optimizer returned by
// amp::initialize - which tensor holds which gradient, and every transition
// between scale_loss guards and steps. scale_loss, MixedPrecisionOptimizer
// and checkpoints change gradient state only through this class.
//
// Per parameter the optimizer steps (a "slot"):
//   accumulator  the gradient step() uses: the fp32 master's .grad with master
//                weights (O2/O5), otherwise the parameter's own .grad. It
//                holds true (unscaled) values, except during delay_unscale
//                accumulation, when it holds values scaled by that loss's
//                scaler.
//   scratch      master weights only: the low-precision model parameter's
//                .grad. Autograd writes it during a guard's backward; the
//                guard moves it into the accumulator and frees it.
//
//   event                  accumulator                     scratch     queued verdicts
//   ---------------------  ------------------------------  ----------  ---------------------
//   guard opens            set aside, restorable           discarded   dropped when nothing
//                                                          (1)         is accumulated (2)
//   backward               -                               written     -
//   unscale (unscale() or  fresh/scale + aside (3)         freed       -
//     guard end)
//   guard commits          aside dropped                   -           its verdict queued
//   guard unwinds          aside restored, as before the   discarded   unchanged; the loss
//     (exception)          guard                                       scaler is restored
//   optimizer->zero_grad() cleared (LibTorch)              -           dropped at the next
//                                                                      guard or step (2)
//   step()                 stepped, or kept unchanged      -           read (one host sync),
//                          after an overflow verdict;                  then cleared; or (6)
//                          then cleared if skipped (4),
//                          and with master weights (5)
//
// (1) As in Apex: low-precision gradients that a backward this optimizer's
//     guard did not run left on the model (a GAN's generator loss through the
//     discriminator) carry another loss's scale; they are never used.
// (2) A verdict judges the gradients that were accumulated when it was made;
//     once they are cleared (optimizer->zero_grad(), or model->zero_grad()
//     without master weights) it no longer applies to anything.
// (3) delay_unscale: fresh + aside, still scaled. The guard that ends an
//     accumulation unscales the whole sum. Only this backward's values are
//     checked (as in Apex): asides were judged by their own guard, and a
//     guard over several optimizers must not skip those with clean gradients.
// (4) A skipped step's gradients hold inf/NaN; they are discarded so that a
//     loop that never zeroes cannot carry them into the next step.
// (5) As in Apex: model->zero_grad() cannot reach fp32 masters, so step()
//     consumes the gradients it used (taken or skipped). Loops that zero
//     through the model, through the optimizer, or forget to zero therefore
//     all train alike. Unlike fp32 training, forgetting zero_grad at O2/O5
//     does not accumulate across steps; accumulate with delay_unscale.
//     The one gap, shared with Apex: master gradients a guard deposits
//     after this optimizer's step (a later loss whose guard also lists this
//     optimizer) survive model->zero_grad(), which cannot reach masters;
//     optimizer->zero_grad() clears them.
// (6) A fused optimizer (fused_step.h) decides on the device instead: the
//     verdicts' flag goes to its kernel and the step is "pending" until
//     their values reach the host (DeferredVerdicts; on the CPU at once).
//     settle() then counts and logs it, and for a skipped step clears the
//     gradients (4) unless a guard has opened since: a guard opening over
//     gradients kept from a pending step waits for its outcome first.
#pragma once

#include "overflow_verdict.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

namespace amp::detail {

class Context;
class UnscalePlan;

struct ParamSlot {
  at::Tensor model;   // the model's parameter
  at::Tensor master;  // its fp32 master, or `model` itself without one
  at::Tensor aside;   // the accumulator while a guard is open

  bool has_master() const { return !model.is_same(master); }
  at::Tensor& accumulator() const { return master.mutable_grad(); }
  at::Tensor& scratch() const { return model.mutable_grad(); }
};

// Float32 values of converted parameters before conversion, by TensorImpl.
using Fp32Originals = std::unordered_map<const c10::TensorImpl*, at::Tensor>;

class GradientLifecycle {
 public:
  GradientLifecycle(std::weak_ptr<Context> context, bool master_weights);

  // Makes slots for the parameters of `optimizer`'s groups not seen before.
  // With master weights each low-precision one gets an fp32 master (its exact
  // value before conversion when `originals` has it), which takes its place
  // in the group; optimizer state made for it moves onto the master. The
  // optimizer's constructor and add_param_group both come through here.
  void adopt(torch::optim::Optimizer& optimizer, const Fp32Originals& originals = {});

  // The initialization that made the optimizer; null once deinitialized.
  std::shared_ptr<Context> context() const { return context_.lock(); }
  bool master_weights() const { return master_weights_; }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  // Both wait for pending steps' outcomes (a host sync on a GPU when they
  // have not arrived yet).
  int64_t skipped_steps();
  bool last_step_skipped();

  // --- scale_loss guards -----------------------------------------------------
  // Learns what a guard opening now must know of pending steps (6).
  void settle_before_guard();
  // Throws, changing nothing, when a guard for `loss_id` cannot open now.
  void check_can_open(int loss_id, bool delay_unscale) const;
  void open();
  // Adds every slot to the guard's unscale plan.
  void plan_unscale(UnscalePlan& plan);
  // The guard ended well: `verdict` (null for static scales or delay_unscale)
  // decides the next step; `scaled_by` is the loss whose scale the
  // accumulators still carry (delay_unscale), if any.
  void commit(std::shared_ptr<OverflowVerdict> verdict, std::optional<int> scaled_by);
  // The guard ended by an exception: everything as before open().
  void unwind() noexcept;

  // --- step() -----------------------------------------------------------------
  struct StepPlan {
    bool skip = false;      // decided on the host: do not step
    at::Tensor found_inf;   // defined: the device decides (combined_found_inf)
    Verdicts verdicts;      // what found_inf combines
  };
  // Checks the state and decides. With `device_may_decide` (the optimizer
  // can step fused) and only unread verdicts, the plan carries their flag
  // and nothing is read on the host; otherwise the verdicts are read.
  StepPlan begin_step(torch::optim::Optimizer& optimizer, bool device_may_decide);
  // After the optimizer stepped (or not): copies masters into the model, and
  // with master weights consumes the gradients. A device-decided step stays
  // pending until settle() learns its outcome.
  void end_step(StepPlan plan);
  // Learns the outcome of pending steps whose verdicts reached the host, or
  // with `wait`, of all of them; calls `on_settle` for each, oldest first.
  void settle(bool wait);
  bool has_pending() const { return !pending_.empty(); }
  void on_settle(std::function<void(bool skipped)> fn) { on_settle_ = std::move(fn); }

 private:
  struct PendingStep {
    DeferredVerdicts verdicts;
    bool gradients_live;  // the accumulators are still this step's
  };
  bool holds_accumulated() const;
  void record_outcome(bool skipped, bool gradients_live);
  void copy_masters_to_model();

  std::weak_ptr<Context> context_;
  bool master_weights_;
  std::vector<ParamSlot> slots_;
  size_t adopted_count_ = 0;
  bool in_guard_ = false;
  std::optional<int> scaled_by_;  // delay_unscale accumulation in progress
  Verdicts verdicts_;
  std::deque<PendingStep> pending_;
  std::function<void(bool skipped)> on_settle_;
  int64_t skipped_steps_ = 0;
  bool last_step_skipped_ = false;
};

}  // namespace amp::detail
