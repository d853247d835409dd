#include "fused_step.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <optional>
#include <typeinfo>

namespace amp::detail {
namespace {

bool kernel_ready(const at::Tensor& t, const at::Tensor& param) {
  return !t.defined() || (t.layout() == at::kStrided && t.is_contiguous() &&
                          t.scalar_type() == param.scalar_type() && t.device() == param.device() &&
                          t.sizes() == param.sizes());
}

// The state tensors the kernels would update for `param`, if it has state.
std::vector<at::Tensor> state_tensors(const torch::optim::OptimizerParamState& s) {
  if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(&s)) {
    return {adam->exp_avg(), adam->exp_avg_sq(), adam->max_exp_avg_sq()};
  }
  if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(&s)) {
    return {adamw->exp_avg(), adamw->exp_avg_sq(), adamw->max_exp_avg_sq()};
  }
  if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(&s)) {
    return {sgd->momentum_buffer()};
  }
  return {at::Tensor(), at::empty({0})};  // unknown state: never ready
}

}  // namespace

std::unique_ptr<FusedStep> FusedStep::make(const torch::optim::Optimizer& optimizer) {
  const std::type_info& type = typeid(optimizer);
  if (type == typeid(torch::optim::Adam)) return std::unique_ptr<FusedStep>(new FusedStep(Kind::kAdam));
  if (type == typeid(torch::optim::AdamW)) return std::unique_ptr<FusedStep>(new FusedStep(Kind::kAdamW));
  if (type == typeid(torch::optim::SGD)) return std::unique_ptr<FusedStep>(new FusedStep(Kind::kSgd));
  return nullptr;
}

bool FusedStep::suits(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                      const StateMap& state) const {
  std::optional<c10::Device> device;
  for (const auto& group : groups) {
    const bool amsgrad =
        kind_ == Kind::kAdam    ? static_cast<const torch::optim::AdamOptions&>(group.options()).amsgrad()
        : kind_ == Kind::kAdamW ? static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad()
                                : false;
    for (const at::Tensor& p : group.params()) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      if (p.scalar_type() != at::kFloat && p.scalar_type() != at::kDouble) return false;
      if (!(p.is_cpu() || p.is_cuda()) || !p.is_contiguous() || !kernel_ready(grad, p)) return false;
      if (device && *device != p.device()) return false;
      device = p.device();
      auto s = state.find(p.unsafeGetTensorImpl());
      if (s == state.end()) continue;
      const std::vector<at::Tensor> tensors = state_tensors(*s->second);
      for (size_t i = 0; i < tensors.size(); ++i) {
        const bool needed = kind_ == Kind::kSgd || i < 2 || amsgrad;  // Adam's third: amsgrad only
        if (needed && (!tensors[i].defined() || !kernel_ready(tensors[i], p))) return false;
      }
    }
  }
  return true;
}

bool FusedStep::awaits_outcome() const {
  for (const Attempt& a : attempts_) {
    if (!a.created.empty()) return true;
  }
  return false;
}

void FusedStep::step(std::vector<torch::optim::OptimizerParamGroup>& groups, StateMap& state,
                     const at::Tensor& found_inf) {
  at::NoGradGuard no_grad;
  attempts_.emplace_back();
  // Adam's step counts move only if the step is taken; SGD keeps none.
  const at::Tensor advance = kind_ == Kind::kSgd ? at::Tensor() : (1 - found_inf).reshape({});
  for (auto& group : groups) {
    switch (kind_) {
      case Kind::kAdam:
        step_adam<torch::optim::AdamOptions, torch::optim::AdamParamState>(group, state, found_inf, advance);
        break;
      case Kind::kAdamW:
        step_adam<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(group, state, found_inf, advance);
        break;
      case Kind::kSgd:
        step_sgd(group, state, found_inf);
        break;
    }
  }
}

// LibTorch's Adam / AdamW step (torch/optim/adam.cpp, adamw.cpp) with the
// state it would create, as one fused kernel call per group.
template <class Options, class ParamState>
void FusedStep::step_adam(torch::optim::OptimizerParamGroup& group, StateMap& state,
                          const at::Tensor& found_inf, const at::Tensor& advance) {
  const auto& options = static_cast<const Options&>(group.options());
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  Attempt& attempt = attempts_.back();
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
  const at::Tensor flag = found_inf.to(params.front().device());
  at::_foreach_add_(steps, advance.to(params.front().device()));
  const auto [beta1, beta2] = options.betas();
  if (kind_ == Kind::kAdamW) {
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options.lr(), beta1,
                      beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                      /*maximize=*/false, /*grad_scale=*/std::nullopt, flag);
  } else {
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options.lr(), beta1,
                     beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                     /*maximize=*/false, /*grad_scale=*/std::nullopt, flag);
  }
}

// LibTorch's SGD step (torch/optim/sgd.cpp): parameters without a momentum
// buffer yet take their first step, which sets it to the gradient.
void FusedStep::step_sgd(torch::optim::OptimizerParamGroup& group, StateMap& state,
                         const at::Tensor& found_inf) {
  const auto& options = static_cast<const torch::optim::SGDOptions&>(group.options());
  const bool momentum = options.momentum() != 0;
  struct Batch {
    std::vector<at::Tensor> params, grads, buffers;
  } continuing, first;
  Attempt& attempt = attempts_.back();
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
    at::_fused_sgd_(batch->params, batch->grads, batch->buffers, options.weight_decay(),
                    options.momentum(), options.lr(), options.dampening(), options.nesterov(),
                    /*maximize=*/false, /*is_first_step=*/batch == &first, /*grad_scale=*/std::nullopt,
                    found_inf.to(batch->params.front().device()));
  }
}

template <class ParamState>
void FusedStep::count_steps(const std::vector<void*>& stepped, StateMap& state) {
  for (void* key : stepped) {
    if (auto it = state.find(key); it != state.end()) {
      auto& s = static_cast<ParamState&>(*it->second);
      s.step(s.step() + 1);
    }
  }
}

void FusedStep::settle(bool skipped, StateMap& state) {
  TORCH_INTERNAL_ASSERT(!attempts_.empty(), "amp: a fused step settled that never ran");
  const Attempt attempt = std::move(attempts_.front());
  attempts_.pop_front();
  if (skipped) {  // LibTorch creates no state on a step it does not take
    for (void* key : attempt.created) {
      state.erase(key);
      device_steps_.erase(key);
    }
    return;
  }
  if (kind_ == Kind::kAdam) count_steps<torch::optim::AdamParamState>(attempt.stepped, state);
  if (kind_ == Kind::kAdamW) count_steps<torch::optim::AdamWParamState>(attempt.stepped, state);
}

void FusedStep::reset() {
  TORCH_INTERNAL_ASSERT(attempts_.empty(), "amp: fused step counts reset with a step pending");
  device_steps_.clear();
}

}  // namespace amp::detail
