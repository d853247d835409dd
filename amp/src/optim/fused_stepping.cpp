#include "optim/fused_stepping.h"

#include "optim/optimizer_kinds.h"
#include "support/host_read.h"
#include "support/trace_range.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <map>
#include <optional>
#include <tuple>

namespace amp::optim::internal {
namespace {

bool kernel_ready(const at::Tensor& t, const at::Tensor& param, c10::ScalarType dtype) {
  return !t.defined() || (t.layout() == at::kStrided && t.is_contiguous() && t.scalar_type() == dtype &&
                          t.device() == param.device() && t.sizes() == param.sizes());
}

// At most this many elements of parameters are widened to float32 at once
// (UpdateRounding): 4 MiB per widened list, a few per step - a transient
// that stays small beside the bytes O6 saves.
constexpr int64_t kChunkElements = int64_t{1} << 20;

// Steps `columns` (parallel lists; column 0 the parameters) through
// `kernel` in float32, a chunk at a time: bfloat16 tensors are widened,
// float32 ones passed as they are; afterwards the bfloat16 tensors of the
// columns the kernel writes (`written`) take its results, rounded
// stochastically. Empty columns stay empty.
template <class Kernel>
void step_widened(const std::vector<const std::vector<at::Tensor>*>& columns, const std::vector<bool>& written,
                  detail::StochasticRounding& rounder, const Kernel& kernel) {
  const std::vector<at::Tensor>& params = *columns[0];
  for (size_t begin = 0; begin < params.size();) {
    size_t end = begin;
    for (int64_t elements = 0; end < params.size() && (end == begin || elements + params[end].numel() <= kChunkElements);
         ++end) {
      elements += params[end].numel();
    }
    std::vector<std::vector<at::Tensor>> wide(columns.size());
    for (size_t c = 0; c < columns.size(); ++c) {
      if (columns[c]->empty()) continue;
      for (size_t i = begin; i < end; ++i) {
        const at::Tensor& t = (*columns[c])[i];
        wide[c].push_back(t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t);
      }
    }
    kernel(wide);
    for (size_t c = 0; c < columns.size(); ++c) {
      if (!written[c] || columns[c]->empty()) continue;
      for (size_t i = begin; i < end; ++i) {
        const at::Tensor& t = (*columns[c])[i];
        if (t.scalar_type() == at::kBFloat16) rounder.round_into(wide[c][i - begin], t);
      }
    }
    begin = end;
  }
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

// The dtype of the state a step creates for `p`.
c10::ScalarType state_dtype_of(const at::Tensor& p, const UpdateRounding* rounding) {
  return detail::kept_state_dtype(p.scalar_type(), rounding ? std::optional(rounding->state_dtype) : std::nullopt);
}

bool FusedStepping::suits(const torch::optim::Optimizer& optimizer, const UpdateRounding* rounding) const {
  std::optional<c10::Device> device;
  for (const auto& group : optimizer.param_groups()) {
    const bool needs_max = amsgrad(kind_, group.options());
    for (const at::Tensor& p : group.params()) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      // ATen's fused kernels take the four floating dtypes; float16 and
      // bfloat16 parameters (O3) keep their state in their own dtype, as
      // LibTorch's step creates it. But ATen 2.11's CPU _fused_sgd_ leaves
      // float16/bfloat16 parameters of 64 or more elements unchanged (its
      // vectorized loop), so on the CPU those take LibTorch's SGD step;
      // O6's are stepped widened to float32 and are unaffected.
      const c10::ScalarType dtype = p.scalar_type();
      const bool reduced = dtype == at::kHalf || dtype == at::kBFloat16;
      const bool rounded = rounding != nullptr && dtype == at::kBFloat16;
      if (dtype != at::kFloat && dtype != at::kDouble && !reduced) return false;
      if (reduced && !rounded && kind_ == Kind::kSgd && p.is_cpu()) return false;
      if (!(p.is_cpu() || p.is_cuda()) || !p.is_contiguous() || !kernel_ready(grad, p, p.scalar_type())) return false;
      if (device && *device != p.device()) return false;
      device = p.device();
      auto s = optimizer.state().find(p.unsafeGetTensorImpl());
      if (s == optimizer.state().end()) continue;
      int64_t step = 0;
      const std::vector<detail::StateTensor> tensors = detail::state_tensors(*s->second, step);
      if (tensors.empty()) return false;  // state of another kind
      const c10::ScalarType state_dtype = state_dtype_of(p, rounding);
      for (size_t i = 0; i < tensors.size(); ++i) {
        const bool needed = kind_ == Kind::kSgd || i < 2 || needs_max;  // Adam's third: amsgrad only
        if (needed && (!tensors[i].value.defined() || !kernel_ready(tensors[i].value, p, state_dtype))) return false;
      }
    }
  }
  return true;
}

FusedAttempt FusedStepping::step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf,
                                  const UpdateRounding* rounding) {
  AMP_TRACE_RANGE("amp::fused step");
  at::NoGradGuard no_grad;
  FusedAttempt attempt;
  if (rounding != nullptr) rounding->rounder->next_step();
  for (auto& group : optimizer.param_groups()) {
    switch (kind_) {
      case Kind::kAdam:
        step_adam<torch::optim::AdamOptions, torch::optim::AdamParamState>(
            group, optimizer.state(), found_inf, rounding, attempt);
        break;
      case Kind::kAdamW:
        step_adam<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
            group, optimizer.state(), found_inf, rounding, attempt);
        break;
      case Kind::kSgd:
        step_sgd(group, optimizer.state(), found_inf, rounding, attempt);
        break;
    }
  }
  return attempt;
}

// LibTorch's Adam / AdamW step with the state it would create, as one fused
// kernel call per group (per chunk for rounded parameters).
template <class Options, class ParamState>
void FusedStepping::step_adam(torch::optim::OptimizerParamGroup& group, StateMap& state,
                              const at::Tensor& found_inf, const UpdateRounding* rounding,
                              FusedAttempt& attempt) {
  const auto& options = static_cast<const Options&>(group.options());
  struct Lists {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  };
  // ATen's kernels take one dtype per call: direct parameters by dtype
  // (float32 with float16 at O3's kept-float32 batch norms), and the
  // rounded ones (O6), stepped in float32 a chunk at a time.
  std::map<c10::ScalarType, Lists> direct;
  Lists rounded;
  for (const at::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    void* key = p.unsafeGetTensorImpl();
    auto it = state.find(key);
    if (it == state.end()) {
      const at::TensorOptions dtype = p.options().dtype(state_dtype_of(p, rounding));
      auto fresh = std::make_unique<ParamState>();
      fresh->exp_avg(at::zeros_like(p, dtype, at::MemoryFormat::Preserve));
      fresh->exp_avg_sq(at::zeros_like(p, dtype, at::MemoryFormat::Preserve));
      if (options.amsgrad()) fresh->max_exp_avg_sq(at::zeros_like(p, dtype, at::MemoryFormat::Preserve));
      it = state.emplace(key, std::move(fresh)).first;
      attempt.created.push_back(key);
    }
    auto& s = static_cast<ParamState&>(*it->second);
    at::Tensor& step = device_steps_[key];
    if (!step.defined()) step = at::full({}, static_cast<double>(s.step()), p.options().dtype(at::kFloat));
    Lists& lists = rounding != nullptr && p.scalar_type() == at::kBFloat16 ? rounded : direct[p.scalar_type()];
    lists.params.push_back(p);
    lists.grads.push_back(p.grad());
    lists.exp_avgs.push_back(s.exp_avg());
    lists.exp_avg_sqs.push_back(s.exp_avg_sq());
    if (options.amsgrad()) lists.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
    lists.steps.push_back(step);
    attempt.stepped.push_back(key);
  }
  std::vector<Lists*> all;
  for (auto& [dtype, lists] : direct) all.push_back(&lists);
  if (!rounded.params.empty()) all.push_back(&rounded);
  if (all.empty()) return;
  const c10::Device device = all.front()->params.front().device();
  std::optional<at::Tensor> flag;
  if (found_inf.defined()) flag = found_inf.to(device);
  for (Lists* lists : all) {
    if (flag) {
      at::_foreach_add_(lists->steps, (1 - *flag).reshape({}));  // step counts move only if taken
    } else {
      at::_foreach_add_(lists->steps, 1);
    }
  }
  const auto [beta1, beta2] = options.betas();
  auto kernel = [&](at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps) {
    if constexpr (std::is_same_v<Options, torch::optim::AdamWOptions>) {
      at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options.lr(), beta1,
                        beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                        /*maximize=*/false, /*grad_scale=*/std::nullopt, flag);
    } else {
      at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, options.lr(), beta1,
                       beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                       /*maximize=*/false, /*grad_scale=*/std::nullopt, flag);
    }
  };
  for (auto& [dtype, l] : direct) kernel(l.params, l.grads, l.exp_avgs, l.exp_avg_sqs, l.max_exp_avg_sqs, l.steps);
  if (!rounded.params.empty()) {
    step_widened({&rounded.params, &rounded.grads, &rounded.exp_avgs, &rounded.exp_avg_sqs,
                  &rounded.max_exp_avg_sqs, &rounded.steps},
                 {true, false, true, true, true, false}, *rounding->rounder,
                 [&](const std::vector<std::vector<at::Tensor>>& w) { kernel(w[0], w[1], w[2], w[3], w[4], w[5]); });
  }
}

// LibTorch's SGD step: parameters without a momentum buffer yet take their
// first step, which sets it to the gradient.
void FusedStepping::step_sgd(torch::optim::OptimizerParamGroup& group, StateMap& state,
                             const at::Tensor& found_inf, const UpdateRounding* rounding,
                             FusedAttempt& attempt) {
  const auto& options = static_cast<const torch::optim::SGDOptions&>(group.options());
  const bool momentum = options.momentum() != 0;
  struct Batch {
    std::vector<at::Tensor> params, grads, buffers;
  };
  // One kernel call per (dtype, rounded, first step): ATen's kernels take
  // one dtype per call.
  std::map<std::tuple<c10::ScalarType, bool, bool>, Batch> batches;
  for (const at::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    void* key = p.unsafeGetTensorImpl();
    const bool rounded = rounding != nullptr && p.scalar_type() == at::kBFloat16;
    bool first = false;
    at::Tensor buffer;
    if (momentum) {
      auto it = state.find(key);
      if (it == state.end()) {
        auto fresh = std::make_unique<torch::optim::SGDParamState>();
        fresh->momentum_buffer(at::empty_like(p, p.options().dtype(state_dtype_of(p, rounding)),
                                              at::MemoryFormat::Preserve));
        it = state.emplace(key, std::move(fresh)).first;
        attempt.created.push_back(key);
        first = true;
      }
      buffer = static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer();
    }
    Batch& batch = batches[{p.scalar_type(), rounded, first}];
    if (buffer.defined()) batch.buffers.push_back(buffer);
    batch.params.push_back(p);
    batch.grads.push_back(p.grad());
  }
  for (const auto& entry : batches) {
    const bool rounded = std::get<1>(entry.first), first = std::get<2>(entry.first);
    const Batch& batch = entry.second;
    std::optional<at::Tensor> flag;
    if (found_inf.defined()) flag = found_inf.to(batch.params.front().device());
    auto kernel = [&](at::TensorList params, at::TensorList grads, at::TensorList buffers) {
      at::_fused_sgd_(params, grads, buffers, options.weight_decay(), options.momentum(), options.lr(),
                      options.dampening(), options.nesterov(), /*maximize=*/false, /*is_first_step=*/first,
                      /*grad_scale=*/std::nullopt, flag);
    };
    if (!rounded) {
      kernel(batch.params, batch.grads, batch.buffers);
    } else {
      step_widened({&batch.params, &batch.grads, &batch.buffers}, {true, false, true}, *rounding->rounder,
                   [&](const std::vector<std::vector<at::Tensor>>& w) { kernel(w[0], w[1], w[2]); });
    }
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

}  // namespace amp::optim::internal
