#include <amp/fused.h>

#include "context.h"
#include "step/fused_stepping.h"
#include "step/optimizer_kinds.h"
#include "step/optimizer_step.h"
#include "step/overflow_verdict.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

namespace amp::optim {
namespace {

bool kernel_ready(const at::Tensor& t, const at::Tensor& param) {
  return !t.defined() || (t.layout() == at::kStrided && t.is_contiguous() &&
                          t.scalar_type() == param.scalar_type() && t.device() == param.device() &&
                          t.sizes() == param.sizes());
}


bool amsgrad(Fused::Kind kind, const torch::optim::OptimizerOptions& options) {
  switch (kind) {
    case Fused::Kind::kAdam:
      return static_cast<const torch::optim::AdamOptions&>(options).amsgrad();
    case Fused::Kind::kAdamW:
      return static_cast<const torch::optim::AdamWOptions&>(options).amsgrad();
    case Fused::Kind::kSgd:
      return false;
  }
  return false;
}

}  // namespace

// ---- FusedStepping ------------------------------------------------------------

bool FusedStepping::suits(const torch::optim::Optimizer& optimizer) const {
  std::optional<c10::Device> device;
  for (const auto& group : optimizer.param_groups()) {
    const bool needs_max = amsgrad(kind_, group.options());
    for (const at::Tensor& p : group.params()) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      if (p.scalar_type() != at::kFloat && p.scalar_type() != at::kDouble) return false;
      if (!(p.is_cpu() || p.is_cuda()) || !p.is_contiguous() || !kernel_ready(grad, p)) return false;
      if (device && *device != p.device()) return false;
      device = p.device();
      auto s = optimizer.state().find(p.unsafeGetTensorImpl());
      if (s == optimizer.state().end()) continue;
      int64_t step = 0;
      const std::vector<detail::StateTensor> tensors = detail::state_tensors(*s->second, step);
      if (tensors.empty()) return false;  // state of another kind
      for (size_t i = 0; i < tensors.size(); ++i) {
        const bool needed = kind_ == Kind::kSgd || i < 2 || needs_max;  // Adam's third: amsgrad only
        if (needed && (!tensors[i].value.defined() || !kernel_ready(tensors[i].value, p))) return false;
      }
    }
  }
  return true;
}

FusedAttempt FusedStepping::step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf) {
  at::NoGradGuard no_grad;
  FusedAttempt attempt;
  for (auto& group : optimizer.param_groups()) {
    switch (kind_) {
      case Kind::kAdam:
        step_adam<torch::optim::AdamOptions, torch::optim::AdamParamState>(
            group, optimizer.state(), found_inf, attempt);
        break;
      case Kind::kAdamW:
        step_adam<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
            group, optimizer.state(), found_inf, attempt);
        break;
      case Kind::kSgd:
        step_sgd(group, optimizer.state(), found_inf, attempt);
        break;
    }
  }
  return attempt;
}

// LibTorch's Adam / AdamW step with the state it would create, as one fused
// kernel call per group.
template <class Options, class ParamState>
void FusedStepping::step_adam(torch::optim::OptimizerParamGroup& group, StateMap& state,
                              const at::Tensor& found_inf, FusedAttempt& attempt) {
  const auto& options = static_cast<const Options&>(group.options());
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  for (const at::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    void* key = p.unsafeGetTensorImpl();
    auto it = state.find(key);
    if (it == state.end()) {
      auto fresh = std::make_unique<ParamState>();
      fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
      fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      if (options.amsgrad()) fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      it = state.emplace(key, std::move(fresh)).first;
      attempt.created.push_back(key);
    }
    auto& s = static_cast<ParamState&>(*it->second);
    at::Tensor& step = device_steps_[key];
    if (!step.defined()) step = at::full({}, static_cast<double>(s.step()), p.options().dtype(at::kFloat));
    params.push_back(p);
    grads.push_back(p.grad());
    exp_avgs.push_back(s.exp_avg());
    exp_avg_sqs.push_back(s.exp_avg_sq());
    if (options.amsgrad()) max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
    steps.push_back(step);
    attempt.stepped.push_back(key);
  }
  if (params.empty()) return;
  const c10::Device device = params.front().device();
  std::optional<at::Tensor> flag;
  if (found_inf.defined()) {
    flag = found_inf.to(device);
    at::_foreach_add_(steps, (1 - *flag).reshape({}));  // step counts move only if taken
  } else {
    at::_foreach_add_(steps, 1);
  }
  const auto [beta1, beta2] = options.betas();
  if constexpr (std::is_same_v<Options, torch::optim::AdamWOptions>) {
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options.lr(), beta1,
                      beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                      /*maximize=*/false, /*grad_scale=*/std::nullopt, flag);
  } else {
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options.lr(), beta1,
                     beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                     /*maximize=*/false, /*grad_scale=*/std::nullopt, flag);
  }
}

// LibTorch's SGD step: parameters without a momentum buffer yet take their
// first step, which sets it to the gradient.
void FusedStepping::step_sgd(torch::optim::OptimizerParamGroup& group, StateMap& state,
                             const at::Tensor& found_inf, FusedAttempt& attempt) {
  const auto& options = static_cast<const torch::optim::SGDOptions&>(group.options());
  const bool momentum = options.momentum() != 0;
  struct Batch {
    std::vector<at::Tensor> params, grads, buffers;
  } continuing, first;
  for (const at::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    void* key = p.unsafeGetTensorImpl();
    Batch* batch = &continuing;
    if (momentum) {
      auto it = state.find(key);
      if (it == state.end()) {
        auto fresh = std::make_unique<torch::optim::SGDParamState>();
        fresh->momentum_buffer(at::empty_like(p, at::MemoryFormat::Preserve));
        it = state.emplace(key, std::move(fresh)).first;
        attempt.created.push_back(key);
        batch = &first;
      }
      batch->buffers.push_back(static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer());
    }
    batch->params.push_back(p);
    batch->grads.push_back(p.grad());
  }
  for (Batch* batch : {&continuing, &first}) {
    if (batch->params.empty()) continue;
    std::optional<at::Tensor> flag;
    if (found_inf.defined()) flag = found_inf.to(batch->params.front().device());
    at::_fused_sgd_(batch->params, batch->grads, batch->buffers, options.weight_decay(),
                    options.momentum(), options.lr(), options.dampening(), options.nesterov(),
                    /*maximize=*/false, /*is_first_step=*/batch == &first, /*grad_scale=*/std::nullopt,
                    flag);
  }
}

void FusedStepping::settle(const FusedAttempt& attempt, bool skipped, StateMap& state) {
  if (skipped) {  // LibTorch creates no state on a step it does not take
    for (void* key : attempt.created) {
      state.erase(key);
      device_steps_.erase(key);
    }
    return;
  }
  for (void* key : attempt.stepped) {
    if (auto it = state.find(key); it != state.end()) detail::count_step(*it->second);
  }
}

bool FusedStepping::holds_all_state(const torch::optim::Optimizer& optimizer) const {
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      void* key = p.unsafeGetTensorImpl();
      if (!optimizer.state().count(key)) return false;
      if (kind_ != Kind::kSgd && !device_steps_.count(key)) return false;
    }
  }
  return true;
}

void FusedStepping::adopt_device_counts(StateMap& state) {
  std::vector<void*> keys;
  std::vector<at::Tensor> counts;
  for (const auto& [key, count] : device_steps_) {
    if (!state.count(key)) continue;
    keys.push_back(key);
    counts.push_back(count);
  }
  if (keys.empty()) return;
  const at::Tensor host = at::stack(counts).to(at::kDouble).cpu();  // one host sync
  detail::count_host_read();
  for (size_t i = 0; i < keys.size(); ++i) {
    detail::set_step_count(*state.at(keys[i]), static_cast<int64_t>(host[i].item<double>()));
  }
}

// ---- Fused and the optimizers ---------------------------------------------------

Fused::Fused(Kind kind) : stepping_(std::make_unique<FusedStepping>(kind)) {}
Fused::Fused(Fused&&) noexcept = default;
Fused::~Fused() = default;

// Returns false when LibTorch's own step must run instead.
bool Fused::fused_step(torch::optim::Optimizer& optimizer) {
  detail::OptimizerStep* amp_step = detail::live_optimizer_step(optimizer);
  const bool kernels = stepping_->suits(optimizer);
  detail::OptimizerStep::FusedDecision decision;
  if (amp_step != nullptr) decision = amp_step->begin_fused_step(kernels);
  if (decision.skip) return true;
  if (!kernels) {
    stepping_->reset();  // LibTorch's step counts on the host
    return false;
  }
  FusedAttempt attempt = stepping_->step(optimizer, decision.found_inf);
  if (amp_step != nullptr) {
    amp_step->end_fused_step(std::move(attempt), std::move(decision));
  } else {
    stepping_->settle(attempt, /*skipped=*/false, optimizer.state());
  }
  return true;
}

namespace {

at::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode grad(true);
  return closure();
}

}  // namespace

at::Tensor FusedAdam::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  if (!fused_step(*this)) Adam::step();
  return loss;
}
at::Tensor FusedAdamW::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  if (!fused_step(*this)) AdamW::step();
  return loss;
}
at::Tensor FusedSGD::step(LossClosure closure) {
  at::Tensor loss = run_closure(closure);
  if (!fused_step(*this)) SGD::step();
  return loss;
}

void FusedAdam::load(torch::serialize::InputArchive& archive) {
  Adam::load(archive);
  stepping().reset();
}
void FusedAdamW::load(torch::serialize::InputArchive& archive) {
  AdamW::load(archive);
  stepping().reset();
}
void FusedSGD::load(torch::serialize::InputArchive& archive) {
  SGD::load(archive);
  stepping().reset();
}

}  // namespace amp::optim
