#include <amp/scale_loss.h>

#include <amp/cast_cache.h>
#include <amp/optimizer.h>

#include "context.h"
#include "gradient_lifecycle.h"
#include "non_finite_check.h"
#include "unscale_plan.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <exception>
#include <vector>

namespace amp {
namespace {

detail::GradientLifecycle& lifecycle_for_guard(const std::shared_ptr<torch::optim::Optimizer>& optimizer,
                                               const detail::Context& context) {
  TORCH_CHECK(optimizer != nullptr, "amp: scale_loss got a null optimizer.");
  detail::GradientLifecycle& lifecycle = detail::lifecycle_of(*optimizer);
  TORCH_CHECK(lifecycle.context().get() == &context, "amp: this optimizer was returned by an "
              "earlier amp::initialize that has since been deinitialized; initialize amp again "
              "with a fresh optimizer.");
  return lifecycle;
}

}  // namespace

scale_loss::scale_loss(const at::Tensor& loss,
                       const std::shared_ptr<torch::optim::Optimizer>& optimizer,
                       ScaleLossOptions options)
    : scale_loss(loss, std::vector<std::shared_ptr<torch::optim::Optimizer>>{optimizer}, options) {}

scale_loss::scale_loss(const at::Tensor& loss,
                       const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers,
                       ScaleLossOptions options)
    : options_(options), uncaught_at_entry_(std::uncaught_exceptions()) {
  std::shared_ptr<detail::Context> context = detail::require_live_context("amp::scale_loss");
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
  bool any_masters = false;
  for (const auto& optimizer : optimizers) {  // validate everything before changing anything
    detail::GradientLifecycle& lifecycle = lifecycle_for_guard(optimizer, *context);
    lifecycle.settle_before_guard();
    lifecycle.check_can_open(options.loss_id, options.delay_unscale);
    any_masters = any_masters || lifecycle.master_weights();
    lifecycles_.push_back(&lifecycle);
  }
  const LossScale& configured = context->properties().loss_scale;
  passthrough_ = !configured.dynamic && configured.value == 1.0 && !any_masters;
  const at::Tensor fp32_loss = loss.to(at::kFloat);
  scaled_loss_ = passthrough_ ? fp32_loss
                              : fp32_loss * context->scaler(options.loss_id)
                                                .scale_tensor(loss.device())
                                                .reshape(loss.sizes());
  for (size_t i = 0; i < optimizers.size(); ++i) {
    lifecycles_[i]->adopt(*optimizers[i]);  // parameter groups added since the last step
    lifecycles_[i]->open();
  }
  context_ = std::move(context);
}

scale_loss::~scale_loss() noexcept(false) {
  if (stage_ == Stage::kFinished) return;
  if (std::uncaught_exceptions() > uncaught_at_entry_) {
    unwind();
    return;
  }
  finish();
}

void scale_loss::backward(std::optional<bool> retain_graph, bool create_graph) {
  scaled_loss_.backward({}, retain_graph, create_graph);
}

at::Tensor scale_loss::loss_scale() const {
  return context_->scaler(options_.loss_id).scale_tensor(scaled_loss_.device());
}

void scale_loss::unscale() {
  TORCH_CHECK(stage_ == Stage::kOpen, "amp: unscale() was already called for this scale_loss, "
              "or the guard has finished; gradients are unscaled at most once per backward.");
  TORCH_CHECK(!options_.delay_unscale, "amp: unscale() contradicts delay_unscale=true; unscale "
              "in the last micro-batch's guard (delay_unscale=false).");
  scaler_before_ = context_->scaler(options_.loss_id).state();
  unscale_gradients();
  if (lifecycles_.size() > 1) check_kept_gradients();
  stage_ = Stage::kUnscaled;
}

void scale_loss::check_kept_gradients() {
  if (!verdict_) return;  // nothing can skip (static scale)
  std::vector<at::Tensor> kept;
  for (detail::GradientLifecycle* lifecycle : lifecycles_) {
    for (const detail::ParamSlot& s : lifecycle->slots()) {
      if (s.accumulator().defined()) kept.push_back(s.accumulator());
    }
  }
  at::Tensor flag = verdict_->snapshot.narrow(0, 0, 1);
  at::Tensor seen = at::zeros({1}, flag.options());
  detail::non_finite_check_and_unscale(kept, seen, at::ones({1}, flag.options()));  // x * 1: a check only
  flag.copy_(at::maximum(flag, seen));
}

void scale_loss::unscale_gradients() {
  detail::UnscalePlan plan;
  for (detail::GradientLifecycle* lifecycle : lifecycles_) lifecycle->plan_unscale(plan);
  LossScaler& scaler = context_->scaler(options_.loss_id);
  const bool unscaling = !options_.delay_unscale && !passthrough_;
  at::Tensor found_inf;
  if (unscaling) found_inf = at::zeros({1}, scaler.scale_tensor(scaled_loss_.device()).options());
  plan.run(unscaling ? &scaler : nullptr, found_inf);
  if (!unscaling || !scaler.dynamic()) return;  // a static scale never skips
  context_->reduce_overflow(found_inf);
  verdict_ = std::make_shared<detail::OverflowVerdict>();
  verdict_->snapshot = scaler.update(found_inf);
  verdict_->loss_id = options_.loss_id;
  verdict_->context = context_;
}

void scale_loss::finish() {
  TORCH_CHECK(stage_ != Stage::kFinished, "amp: finish() was already called for this scale_loss.");
  try {
    if (stage_ == Stage::kOpen) unscale_gradients();
  } catch (...) {
    unwind();
    throw;
  }
  const std::optional<int> scaled_by =
      options_.delay_unscale ? std::optional<int>(options_.loss_id) : std::nullopt;
  for (detail::GradientLifecycle* lifecycle : lifecycles_) lifecycle->commit(verdict_, scaled_by);
  stage_ = Stage::kFinished;
  clear_cast_cache();
}

void scale_loss::unwind() noexcept {
  for (detail::GradientLifecycle* lifecycle : lifecycles_) lifecycle->unwind();
  if (scaler_before_) context_->scaler(options_.loss_id).restore(*scaler_before_);
  verdict_.reset();
  stage_ = Stage::kFinished;
  clear_cast_cache();
}

}  // namespace amp
