// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// scale_loss: the RAII guard around backward (Apex's `with amp.scale_loss`).
///
/// ```
///   optimizer.zero_grad();
///   auto loss = torch::cross_entropy_loss(model->forward(x), y);
///   {
///     amp::scale_loss scaled(loss, optimizer);
///     scaled.backward();            // backward of loss.float() * scale
///   }                               // unscale, overflow check, scale update
///   optimizer.step();               // the program's own step; skipped after an overflow
/// ```
///
/// The optimizer is passed as the program holds it (internal/refs.h); several go in
/// braces: amp::scale_loss scaled(loss, {opt_g, opt_d}).
///
/// While the guard lives, amp's per-op casting is off on this thread. When it
/// ends it unscales the gradients this backward produced (float32 gradients
/// on the master weights at O2/O5), checks them for inf/NaN, updates the loss
/// scaler of `loss_id`, and clears the cast caches (amp's and LibTorch's
/// native autocast cache: one iteration ends). After an overflow the
/// optimizers passed in lose the gradients they hold, so their next step()
/// changes nothing (parameters and optimizer state stay bit-identical); the
/// guard reads that verdict from the device (one host sync) unless every
/// optimizer passed in is one of amp's fused optimizers (fused.h), which
/// skip on the device.
///
/// A guard is a transaction over gradients and the loss scaler: it commits
/// when it ends normally and unwinds when an exception leaves its scope -
/// from backward, or from user code after unscale() (a clipping routine that
/// rejects non-finite gradients). Unwinding restores every gradient and the
/// loss scaler exactly as they were before the guard; the next iteration
/// trains normally.
///
/// Several losses: gradients already accumulated when a guard opens are kept
/// aside and added back after unscaling, so losses with different scales
/// (num_losses > 1, loss_id) combine correctly. At O2/O5, gradients that a
/// backward leaves on master weights of optimizers the guard does not cover
/// (a GAN's generator loss through the discriminator) carry another loss's
/// scale; they are discarded and those weights keep the gradients they had.
/// Gradient accumulation: delay_unscale=true leaves the micro-batch's
/// gradients scaled and unchecked; the last micro-batch's guard
/// (delay_unscale=false) unscales and checks the sum. With an optimizer
/// whose step amp cannot see (LibTorch's own), an overflow in one guard
/// discards what its optimizers accumulated so far, and later guards start
/// afresh; accumulate with delay_unscale to skip the whole step instead.
/// Clipping: gradients are true values after the guard; inside it call
/// unscale() first. Gradient penalty: loss_scale() is the current scale.
///
/// finish() ends the guard explicitly, where its errors are expected. The
/// destructor never throws: an error it meets (a failed distributed
/// all-reduce, an overflow at the scale's floor with DynamicScaling::AtFloor::kRaise) is
/// raised by the next guard's constructor instead, after this guard's
/// gradients were discarded.
///
/// Errors (c10::Error). The constructor (nothing is changed):
///   - amp is not initialized; an error left by an earlier guard's destructor;
///   - the loss is undefined, not floating point, or has more than one element;
///   - loss_id outside [0, num_losses);
///   - no optimizer, a null one, or one not passed to the live amp::initialize;
///   - an optimizer already inside another live guard;
///   - accumulation (delay_unscale) pending from another loss_id, or
///     delay_unscale=true over gradients that hold unscaled values;
///   - an optimizer that stepped while delay_unscale accumulation left its
///     gradients scaled;
///   - at O2/O5: a master weight with a float16/bfloat16 gradient (a backward
///     ran outside amp::scale_loss), or one converted to another dtype behind
///     amp's back (e.g. model->to(torch::kHalf));
///   - inside a CUDA graph capture: a loss scaler not yet used on the loss's
///     device (warm up before capturing), or, with a dynamic scale, one of
///     LibTorch's own optimizers (it needs the verdict on the host; capture
///     with amp::optim's fused ones), or with Options::data_parallel (its
///     hooks and collectives are driven by the host). See docs/guide.md,
///     CUDA graphs.
///   - with Properties::step_in_backward: delay_unscale=true, a CUDA graph
///     capture, or an optimizer whose step() was not called since the last
///     guard over it (two guards would step it twice in one iteration).
///
/// backward() with step_in_backward: a second backward through the same
/// parameters in one guard; a gradient amp's fused kernels cannot step (a
/// sparse one). The parameters already stepped stay stepped.
/// unscale(): called twice, after finish(), with delay_unscale, or with
/// step_in_backward (the gradients were applied and freed in backward).
/// finish(): called twice; errors of the overflow all-reduce; an overflow at
/// the floor with DynamicScaling::AtFloor::kRaise; a failure while the step
/// commits (memory for ZeRO-1's held sums, float8's scale update), which
/// unwinds the whole guard: gradients, optimizer and loss scale as before
/// it. The guard has ended when finish() throws.
#pragma once

#include <amp/internal/refs.h>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <initializer_list>
#include <memory>
#include <optional>
#include <vector>

namespace amp {

/// The guard's choices besides the loss and its optimizers.
struct ScaleLossOptions {
  int loss_id = 0;  ///< which loss scaler scales this loss (0 to Options::num_losses - 1)
  bool delay_unscale = false;  ///< true: leave the gradients scaled and unchecked (accumulation)
};

/// The RAII guard around backward (Apex's `with amp.scale_loss`): scales the
/// loss, then unscales and checks the gradients and updates the loss scale
/// when it ends (see scale_loss.h).
class [[nodiscard]] scale_loss {
 public:
  /// Opens the guard over `loss` and the optimizers whose gradients its
  /// backward produces: one, several in braces, or a std::vector of them.
  ///@{
  scale_loss(const at::Tensor& loss, internal::OptimizerRef optimizer, ScaleLossOptions options = {});
  scale_loss(const at::Tensor& loss, std::initializer_list<internal::OptimizerRef> optimizers,
             ScaleLossOptions options = {});
  template <class O>
  scale_loss(const at::Tensor& loss, const std::vector<O>& optimizers, ScaleLossOptions options = {})
      : scale_loss(loss, std::vector<internal::OptimizerRef>(optimizers.begin(), optimizers.end()), options, 0) {}
  ///@}
  ~scale_loss();
  scale_loss(const scale_loss&) = delete;
  scale_loss& operator=(const scale_loss&) = delete;

  /// loss.float() * scale, for backward or torch::autograd::grad.
  const at::Tensor& scaled_loss() const;
  /// Runs backward from scaled_loss(); `retain_graph` and `create_graph` as
  /// in at::Tensor::backward.
  void backward(std::optional<bool> retain_graph = std::nullopt, bool create_graph = false);
  /// The current scale: a 1-element float32 tensor on the loss's device.
  at::Tensor loss_scale() const;
  /// Unscale and check now (before clipping inside the guard); at most once.
  /// Over several optimizers it also checks the gradients kept from earlier
  /// guards: a norm clipped across them would carry another loss's overflow
  /// into every gradient, so any non-finite value skips the next step of
  /// every optimizer this guard covers (the loss scale is unaffected).
  void unscale();
  /// Ends the guard: unscale (unless done), update the scaler, commit.
  void finish();

  class State;  // the guard's transaction (private)

 private:
  scale_loss(const at::Tensor& loss, c10::ArrayRef<internal::OptimizerRef> optimizers, ScaleLossOptions options,
             int);
  std::unique_ptr<State> state_;
};

}  // namespace amp
