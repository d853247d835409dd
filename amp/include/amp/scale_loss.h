// scale_loss: the RAII guard around backward (Apex's `with amp.scale_loss`).
//
//   optimizer->zero_grad();
//   auto loss = torch::cross_entropy_loss(model->forward(x), y);
//   {
//     amp::scale_loss scaled(loss, optimizer);
//     scaled.backward();            // backward of loss.float() * scale
//   }                               // unscale, overflow check, scale update
//   optimizer->step();              // skipped after an overflow
//
// While the guard lives, amp's per-op casting is off on this thread. When it
// ends it unscales the gradients this backward produced (into the fp32 master
// gradients at O2/O5), checks them for inf/NaN, updates the loss scaler of
// `loss_id`, arranges for the next step() of every optimizer passed in to be
// skipped after an overflow, and clears the cast caches (amp's and LibTorch's
// native autocast cache: one iteration ends).
//
// A guard is a transaction over gradients and the loss scaler: it commits
// when it ends normally and unwinds when an exception leaves its scope -
// from backward, or from user code after unscale() (a clipping routine that
// rejects non-finite gradients). Unwinding restores every gradient and the
// loss scaler exactly as they were before the guard and queues no skip; the
// next iteration trains normally.
//
// Several losses: gradients already accumulated when a guard opens are kept
// aside and added back after unscaling, so losses with different scales
// (num_losses > 1, loss_id) combine correctly. With master weights, the
// model's low-precision gradients are scratch: whatever a backward outside
// this optimizer's guards left there (a GAN's generator loss through the
// discriminator) is discarded when the guard opens. Gradient accumulation:
// delay_unscale=true leaves the micro-batch's gradients scaled and
// unchecked; the last micro-batch's guard (delay_unscale=false) unscales and
// checks the sum. Clipping: gradients are true values after the guard;
// inside it call unscale() first. Gradient penalty: loss_scale() is the
// current scale.
//
// finish() ends the guard explicitly, where its errors are expected; the
// destructor then does nothing. Without finish(), the destructor ends the
// guard (and may throw its errors: it is noexcept(false)), or unwinds if an
// exception is leaving the scope.
//
// Errors (c10::Error). The constructor (nothing is changed):
//   - amp is not initialized;
//   - the loss is undefined, not floating point, or has more than one element;
//   - loss_id outside [0, num_losses);
//   - an optimizer that was not returned by the live amp::initialize;
//   - an optimizer already inside another live guard;
//   - accumulation (delay_unscale) pending from another loss_id, or
//     delay_unscale=true over gradients that hold unscaled values.
// unscale(): called twice, after finish(), or with delay_unscale.
// finish() and the destructor: with distributed training, errors of the
// overflow all-reduce; an overflow at the floor with AtFloor::kRaise is
// reported by the next step(). The guard unwinds before an error leaves it.
// finish(): called twice.
#pragma once

#include <amp/casting_scope.h>
#include <amp/loss_scaler.h>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <vector>

namespace amp {

namespace detail {
class Context;
class GradientLifecycle;
struct OverflowVerdict;
}  // namespace detail

struct ScaleLossOptions {
  int loss_id = 0;
  bool delay_unscale = false;
};

class [[nodiscard]] scale_loss {
 public:
  scale_loss(const at::Tensor& loss, const std::shared_ptr<torch::optim::Optimizer>& optimizer,
             ScaleLossOptions options = {});
  scale_loss(const at::Tensor& loss,
             const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers,
             ScaleLossOptions options = {});
  ~scale_loss() noexcept(false);
  scale_loss(const scale_loss&) = delete;
  scale_loss& operator=(const scale_loss&) = delete;

  // loss.float() * scale, for backward or torch::autograd::grad.
  const at::Tensor& scaled_loss() const { return scaled_loss_; }
  void backward(std::optional<bool> retain_graph = std::nullopt, bool create_graph = false);
  // The current scale: a 1-element float32 tensor on the loss's device.
  at::Tensor loss_scale() const;
  // Unscale and check now (before clipping inside the guard); at most once.
  // Over several optimizers it also checks the gradients kept from earlier
  // guards: a norm clipped across them would carry another loss's overflow
  // into every gradient, so any non-finite value skips the next step of
  // every optimizer this guard covers (the loss scale is unaffected).
  void unscale();
  // Ends the guard: unscale (unless done), update the scaler, commit.
  void finish();

 private:
  enum class Stage { kOpen, kUnscaled, kFinished };
  void unscale_gradients();
  void check_kept_gradients();
  void unwind() noexcept;

  std::shared_ptr<detail::Context> context_;
  std::vector<detail::GradientLifecycle*> lifecycles_;  // of the optimizers passed in
  ScaleLossOptions options_;
  at::Tensor scaled_loss_;
  bool passthrough_ = false;  // static scale 1 without masters: no multiply, no unscale
  Stage stage_ = Stage::kOpen;
  std::optional<LossScaler::State> scaler_before_;  // set by unscale(): to unwind its update
  std::shared_ptr<detail::OverflowVerdict> verdict_;
  int uncaught_at_entry_;
  disable_casts no_casts_;
};

}  // namespace amp
