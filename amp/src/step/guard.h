// SPDX-License-Identifier: BSD-3-Clause
// Private: one scale_loss guard's transaction (scale_loss.h) - what it
// covers, what it set aside, how far it got - as its participants
// (step_participant.h) see it. Every transition is in scale_loss.cpp:
//
//   stage       leaves by
//   ----------  -------------------------------------------------------------
//   kOpen       unscale() -> kUnscaled; finish() -> kFinished; unwind
//   kUnscaled   finish() -> kFinished; unwind (restores the scaler too)
//   kFinished   (the guard is over)
//
// At the end each optimizer's state machine gets one GuardOutcome.
#pragma once

#include <amp/casting_scope.h>
#include <amp/internal/loss_scaling.h>
#include <amp/scale_loss.h>

#include "optim/held_gradients.h"
#include "optim/unscale_plan.h"
#include "step/optimizer_step.h"
#include "step/step_session.h"

#include <ATen/core/Tensor.h>

#include <exception>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace amp::detail {

class Guard {
 public:
  enum class Stage { kOpen, kUnscaled, kFinished };

  // Validates everything, then opens: the optimizers' gradients are set
  // aside and the participants join. Errors: scale_loss.h.
  Guard(const at::Tensor& loss, c10::ArrayRef<internal::OptimizerRef> optimizers, ScaleLossOptions options);

  void unscale();     // kOpen -> kUnscaled: reduce, unscale, check, update the scaler
  void commit();      // kOpen | kUnscaled -> kFinished
  void unwind() noexcept;  // -> kFinished, every change undone
  // unscale() called by the program: the scaler's state before it, to
  // unwind; over several optimizers, also checks the kept gradients.
  void unscale_by_program();
  // A participant learned that `params`' gradients are final (GuardPart::
  // gradients_final): every part hears it.
  void gradients_final(const std::vector<at::Tensor>& params);

  // What participants read.
  StepSession& session() const { return *session_; }
  const ScaleLossOptions& options() const { return options_; }
  const std::vector<OptimizerStep*>& steps() const { return steps_; }  // of the optimizers passed in
  // Their parameters; a participant that takes over a slot's gradient (the
  // reduction, the step in backward) edits its slot.
  const std::vector<GradSlot>& slots() const { return slots_; }
  std::vector<GradSlot>& slots() { return slots_; }
  const at::Tensor& scaled_loss() const { return scaled_loss_; }
  bool passthrough() const { return passthrough_; }  // static scale 1 without masters: no multiply, no unscale
  bool capturing() const { return capturing_; }      // inside a CUDA graph capture
  Stage stage() const { return stage_; }
  // scale_loss::backward kept the graph (retain_graph, create_graph): a
  // later backward may run through it.
  bool graph_retained() const { return graph_retained_; }
  void keep_graph() { graph_retained_ = true; }
  // An exception is leaving the scope the guard was made in.
  bool exception_in_scope() const { return std::uncaught_exceptions() > uncaught_at_entry_; }

 private:
  void check_capturable(c10::Device device) const;
  void check_kept_gradients();
  internal::LossScaling& scaler() { return session_->scaler(options_.loss_id); }

  std::shared_ptr<StepSession> session_;
  ScaleLossOptions options_;
  std::vector<OptimizerStep*> steps_;
  std::vector<GradSlot> slots_;
  at::Tensor scaled_loss_;
  uint64_t loss_graph_ = 0;   // the loss's root node's autograd sequence number
  bool passthrough_ = false;
  bool capturing_ = false;
  bool graph_retained_ = false;
  Stage stage_ = Stage::kOpen;
  int uncaught_at_entry_ = std::uncaught_exceptions();
  std::vector<std::unique_ptr<GuardPart>> parts_;  // the participants', in order
  // Master weights of other optimizers, with the gradients they had: a
  // backward through them leaves scratch scaled by this loss, discarded.
  // (This guard's own parameters' gradients are held by their optimizers'
  // records: GradSlot::aside.)
  HeldGradients held_;
  std::optional<internal::LossScaling::State> scaler_before_;  // to unwind an update
  std::shared_ptr<OverflowVerdict> verdict_;
  disable_casts no_casts_;
};

}  // namespace amp::detail
