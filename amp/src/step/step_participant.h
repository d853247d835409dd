// SPDX-License-Identifier: BSD-3-Clause
// Private: what joins the training step without the guard knowing it -
// data-parallel reduction and sharding, precision telemetry, overflow
// provenance. The guard (step/guard.h) runs one transaction:
//
//   open      every participant may refuse the guard (check_open, before
//             anything changed), then joins it (open) and returns its part
//             of this guard (a GuardPart), or null to sit it out;
//   unscale   parts see the gradients before unscaling (reduce them), after
//             it (record them), add the other ranks' overflow flags to this
//             rank's (agree_overflow) and see the verdict (judged);
//   prepare   the guard is ending well: parts do, in order, whatever can
//             fail (allocating, computing), changing nothing their unwind
//             cannot undo; a part that throws unwinds the whole guard;
//   commit    after every part and optimizer prepared: parts finish, in
//             order, and cannot fail - a step commits whole or not at all;
//   unwind    an exception left the guard's scope, or a part failed to
//             prepare: parts undo, in reverse order, and must not throw.
//
// Parts run in the order the session lists its participants (session/
// context.cpp). Adding a participant touches its own file and that list.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

namespace amp::detail {

class Guard;
struct OverflowVerdict;

// One participant's share of one guard.
class GuardPart {
 public:
  virtual ~GuardPart() = default;
  virtual void before_unscale(Guard&) {}
  // During backward, with sharding and Properties::step_in_backward: the
  // averaged gradients of these optimizer parameters (a bucket's pieces)
  // are final.
  virtual void gradients_final(Guard&, const std::vector<at::Tensor>& /*params*/) {}
  virtual void after_unscale(Guard&) {}
  // Only with a dynamic scale, when the guard unscales: combine `found_inf`
  // (this rank's flag, 1 element on the device) with the other ranks'.
  virtual void agree_overflow(Guard&, at::Tensor& /*found_inf*/) {}
  virtual void judged(Guard&, OverflowVerdict&) {}
  virtual void prepare(Guard&) {}
  virtual void commit(Guard&) noexcept {}
  virtual void unwind(Guard&) noexcept {}
};

class StepParticipant {
 public:
  virtual ~StepParticipant() = default;
  // Throws, changing nothing, when `guard` cannot open with this participant.
  virtual void check_open(const Guard&) const {}
  // `guard` opened: its gradients are set aside and its scaled loss made.
  virtual std::unique_ptr<GuardPart> open(Guard& guard) = 0;
  // Outside guards: one of amp's fused optimizers finished its step().
  virtual void after_fused_step(const torch::optim::Optimizer&) {}
  // amp::clip_grad_norm: the squares of this rank's gradients of
  // `optimizer`, summed (1 element), become the whole model's.
  virtual void total_over_ranks(const torch::optim::Optimizer&, at::Tensor& /*sum_of_squares*/) {}
};

}  // namespace amp::detail
