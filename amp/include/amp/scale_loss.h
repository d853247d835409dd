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
// While the guard lives, amp's per-op casting is off on this thread. On exit
// it unscales the gradients this backward produced (fp32 master gradients at
// O2), checks them for inf/NaN, updates the loss scaler of `loss_id`, arranges
// for the next step() of every optimizer passed in to be skipped after an
// overflow, and clears the cast cache (one iteration ends).
//
// Several losses: gradients already present when a guard starts are kept
// aside and added back after unscaling, so losses with different scales
// (num_losses > 1, loss_id) combine correctly. Gradient accumulation:
// delay_unscale=true leaves the micro-batch's gradients scaled and unchecked;
// the last micro-batch's guard (delay_unscale=false) unscales and checks the
// sum. Clipping: gradients are true values after the guard; inside it call
// unscale() first. Gradient penalty: loss_scale() is the current scale.
//
// If backward throws, the guard restores the gradients present before it,
// leaves the scaler untouched and rethrows nothing itself; the next iteration
// trains normally.
//
// Errors (c10::Error, thrown by the constructor; nothing is changed):
//   - amp is not initialized;
//   - the loss is undefined, not floating point, or has more than one element;
//   - loss_id outside [0, num_losses);
//   - an optimizer that was not returned by amp::initialize;
//   - accumulation (delay_unscale) pending from another loss_id on an optimizer.
// unscale(): called twice, or with delay_unscale.
#pragma once

#include <amp/casting_scope.h>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <vector>

namespace amp {

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
  void unscale();

 private:
  void unscale_and_update();
  void finish();
  void abandon() noexcept;

  std::shared_ptr<void> context_;  // keeps amp's live context alive
  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers_;
  ScaleLossOptions options_;
  at::Tensor scaled_loss_;
  bool passthrough_ = false;  // static scale 1 without masters: no multiply, no unscale
  bool unscaled_ = false;
  int uncaught_at_entry_;
  disable_casts no_casts_;
};

}  // namespace amp
