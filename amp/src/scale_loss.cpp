#include <amp/scale_loss.h>

#include <amp/cast_cache.h>
#include <amp/optimizer.h>

#include "context.h"
#include "optimizer_grad_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <exception>

namespace amp {
namespace {

using detail::OptimizerGradState;
using detail::ParamPair;

OptimizerGradState& grad_state_of(const std::shared_ptr<torch::optim::Optimizer>& optimizer,
                                  const detail::Context& context) {
  auto* amp_optimizer = dynamic_cast<MixedPrecisionOptimizer*>(optimizer.get());
  TORCH_CHECK(amp_optimizer != nullptr, "amp: scale_loss got ",
              optimizer ? "an optimizer that amp::initialize did not return" : "a null optimizer",
              ". Pass the optimizer returned by amp::initialize (it replaces the one you "
              "created: std::tie(model, optimizer) = amp::initialize(model, optimizer, ...)).");
  OptimizerGradState& s = amp_optimizer->grad_state();
  TORCH_CHECK(s.context.lock().get() == &context, "amp: this optimizer was returned by an earlier "
              "amp::initialize that has since been deinitialized; initialize amp again with a "
              "fresh optimizer.");
  return s;
}

bool holds_gradients(const OptimizerGradState& s) {
  for (const ParamPair& p : s.params) {
    if (p.model.grad().defined() || (p.has_master() && p.master.grad().defined())) return true;
  }
  return false;
}

// The fused multi-tensor work of one guard exit, collected across optimizers
// and run as a fixed sequence of ATen foreach calls.
struct GradientWork {
  std::vector<at::Tensor> copy_dst, copy_src;            // fresh fp32 master grads <- new grads
  std::vector<at::Tensor> pre_dst, pre_src;              // added before unscaling (scaled units)
  std::vector<at::Tensor> pre_stash_dst, pre_stash_src;  // (separate calls: no aliasing)
  std::vector<at::Tensor> unscale;
  std::vector<at::Tensor> post_dst, post_src;            // added after unscaling (true units)
  std::vector<at::Tensor> post_stash_dst, post_stash_src;

  void run_before_unscale() {
    if (!copy_dst.empty()) at::_foreach_copy_(copy_dst, copy_src);
    if (!pre_dst.empty()) at::_foreach_add_(pre_dst, pre_src);
    if (!pre_stash_dst.empty()) at::_foreach_add_(pre_stash_dst, pre_stash_src);
  }
  void run_after_unscale() {
    if (!post_dst.empty()) at::_foreach_add_(post_dst, post_src);
    if (!post_stash_dst.empty()) at::_foreach_add_(post_stash_dst, post_stash_src);
  }
};

// Queues one parameter's gradients. `scaled` is true when the target keeps
// scaled values (delay_unscale, or the last micro-batch of an accumulation,
// which unscales the whole sum).
void collect(ParamPair& pair, at::Tensor& stash, bool scaled, bool unscale, GradientWork& work) {
  at::Tensor fresh = pair.model.grad();  // this backward's gradient (scaled)
  at::Tensor& target = pair.has_master() ? pair.master.mutable_grad() : pair.model.mutable_grad();
  if (pair.has_master()) {
    pair.model.mutable_grad() = at::Tensor();
    if (fresh.defined()) {
      if (!target.defined()) {
        target = at::empty_like(pair.master, at::MemoryFormat::Preserve);
        work.copy_dst.push_back(target);
        work.copy_src.push_back(fresh);
        if (unscale && !scaled) work.unscale.push_back(target);
      } else if (scaled) {
        work.pre_dst.push_back(target);
        work.pre_src.push_back(fresh);
      } else {
        at::Tensor unscaled = at::empty_like(pair.master, at::MemoryFormat::Preserve);
        work.copy_dst.push_back(unscaled);
        work.copy_src.push_back(fresh);
        work.unscale.push_back(unscaled);
        work.post_dst.push_back(target);
        work.post_src.push_back(unscaled);
      }
    }
  } else if (fresh.defined() && unscale && !scaled) {
    work.unscale.push_back(fresh);
  }
  if (stash.defined()) {
    if (!target.defined()) {
      target = pair.has_master() ? stash.to(at::kFloat) : stash;
    } else if (scaled) {
      work.pre_stash_dst.push_back(target);
      work.pre_stash_src.push_back(stash);
    } else {
      work.post_stash_dst.push_back(target);
      work.post_stash_src.push_back(stash);
    }
    stash = at::Tensor();
  }
  if (scaled && unscale && target.defined()) work.unscale.push_back(target);
}

}  // namespace

scale_loss::scale_loss(const at::Tensor& loss,
                       const std::shared_ptr<torch::optim::Optimizer>& optimizer,
                       ScaleLossOptions options)
    : scale_loss(loss, std::vector<std::shared_ptr<torch::optim::Optimizer>>{optimizer}, options) {}

scale_loss::scale_loss(const at::Tensor& loss,
                       const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers,
                       ScaleLossOptions options)
    : optimizers_(optimizers), options_(options), uncaught_at_entry_(std::uncaught_exceptions()) {
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

  LossScaler& scaler = context->scaler(options.loss_id);
  const LossScale& configured = context->properties().loss_scale;
  bool any_masters = false;
  for (const auto& optimizer : optimizers) {  // validate everything before changing anything
    OptimizerGradState& s = grad_state_of(optimizer, *context);
    TORCH_CHECK(!s.in_guard, "amp: an optimizer is already inside a live scale_loss guard; end "
                "that guard's scope before starting another over the same optimizer.");
    TORCH_CHECK(!s.scaled_by || *s.scaled_by == options.loss_id, "amp: gradient accumulation "
                "with delay_unscale is pending from loss_id ", s.scaled_by.value_or(0),
                "; finish it (delay_unscale=false) with the same loss_id before scaling loss ",
                options.loss_id, ".");
    TORCH_CHECK(!options.delay_unscale || s.scaled_by || !holds_gradients(s),
                "amp: delay_unscale=true while the optimizer's gradients hold unscaled values; "
                "call zero_grad() before the first micro-batch of an accumulation.");
    any_masters = any_masters || s.master_weights;
  }
  passthrough_ = !configured.dynamic && configured.value == 1.0 && !any_masters;

  for (const auto& optimizer : optimizers) {
    OptimizerGradState& s = grad_state_of(optimizer, *context);
    s.refresh(*optimizer);
    s.in_guard = true;
    for (size_t i = 0; i < s.params.size(); ++i) {
      s.stash[i] = std::move(s.params[i].model.mutable_grad());
      s.params[i].model.mutable_grad() = at::Tensor();
    }
  }
  const at::Tensor fp32_loss = loss.to(at::kFloat);
  scaled_loss_ = passthrough_ ? fp32_loss
                              : fp32_loss * scaler.scale_tensor(loss.device()).reshape(loss.sizes());
  context_ = std::move(context);
}

scale_loss::~scale_loss() noexcept(false) {
  if (std::uncaught_exceptions() > uncaught_at_entry_) {
    abandon();
    return;
  }
  finish();
}

void scale_loss::backward(std::optional<bool> retain_graph, bool create_graph) {
  scaled_loss_.backward({}, retain_graph, create_graph);
}

at::Tensor scale_loss::loss_scale() const {
  auto& context = *std::static_pointer_cast<detail::Context>(context_);
  return context.scaler(options_.loss_id).scale_tensor(scaled_loss_.device());
}

void scale_loss::unscale() {
  TORCH_CHECK(!unscaled_, "amp: unscale() was already called for this scale_loss; gradients are "
              "unscaled at most once per backward.");
  TORCH_CHECK(!options_.delay_unscale, "amp: unscale() contradicts delay_unscale=true; unscale "
              "in the last micro-batch's guard (delay_unscale=false).");
  unscale_and_update();
  unscaled_ = true;
}

void scale_loss::unscale_and_update() {
  auto& context = *std::static_pointer_cast<detail::Context>(context_);
  const bool unscale = !options_.delay_unscale && !passthrough_;
  GradientWork work;
  std::vector<OptimizerGradState*> states;
  for (const auto& optimizer : optimizers_) {
    OptimizerGradState& s = grad_state_of(optimizer, context);
    states.push_back(&s);
    const bool scaled = options_.delay_unscale || s.scaled_by.has_value();
    for (size_t i = 0; i < s.params.size(); ++i) collect(s.params[i], s.stash[i], scaled, unscale, work);
    s.scaled_by = options_.delay_unscale ? std::optional<int>(options_.loss_id) : std::nullopt;
  }
  work.run_before_unscale();
  if (options_.delay_unscale) return;  // the sum stays scaled until the last micro-batch
  if (!unscale) {  // static scale 1: gradients are already true values
    work.run_after_unscale();
    return;
  }
  LossScaler& scaler = context.scaler(options_.loss_id);
  const at::Tensor& scale = scaler.scale_tensor(scaled_loss_.device());
  at::Tensor found_inf = at::zeros({1}, scale.options());
  scaler.unscale(work.unscale, found_inf);
  work.run_after_unscale();
  if (!scaler.dynamic()) return;  // a static scale never skips
  context.reduce_overflow(found_inf);
  auto update = std::make_shared<detail::PendingUpdate>();
  update->snapshot = scaler.update(found_inf);
  update->loss_id = options_.loss_id;
  update->context = std::static_pointer_cast<detail::Context>(context_);
  for (OptimizerGradState* s : states) s->pending.push_back(update);
}

void scale_loss::finish() {
  auto release = [&] {
    auto& context = *std::static_pointer_cast<detail::Context>(context_);
    for (const auto& optimizer : optimizers_) grad_state_of(optimizer, context).in_guard = false;
    clear_cast_cache();
  };
  try {
    if (!unscaled_) unscale_and_update();
  } catch (...) {
    release();
    throw;
  }
  release();
}

void scale_loss::abandon() noexcept {
  // Backward failed part-way: drop its partial gradients, give back the ones
  // present before the guard, leave the scaler untouched.
  for (const auto& optimizer : optimizers_) {
    auto* amp_optimizer = dynamic_cast<MixedPrecisionOptimizer*>(optimizer.get());
    OptimizerGradState& s = amp_optimizer->grad_state();
    for (size_t i = 0; i < s.params.size(); ++i) {
      s.params[i].model.mutable_grad() = std::move(s.stash[i]);
      s.stash[i] = at::Tensor();
    }
    s.in_guard = false;
  }
  clear_cast_cache();
}

}  // namespace amp
