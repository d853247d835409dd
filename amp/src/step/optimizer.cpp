#include <amp/optimizer.h>

#include "context.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "step/optimizer_kinds.h"

#include <amp/distributed.h>

#include <cmath>
#include <unordered_set>

namespace amp {
namespace {

detail::OptimizerStep& step_of(OptimizerRef optimizer, const char* what) {
  return detail::require_live_context(what)->require_step(optimizer.get(), what);
}

}  // namespace

std::vector<at::Tensor> master_params(OptimizerRef optimizer) {
  const detail::OptimizerStep& step = step_of(optimizer, "amp::master_params");
  std::vector<at::Tensor> out;
  for (const auto& group : step.optimizer().param_groups()) {
    out.insert(out.end(), group.params().begin(), group.params().end());
  }
  return out;
}

int64_t skipped_steps(OptimizerRef optimizer) {
  return step_of(optimizer, "amp::skipped_steps").skipped_steps();
}

bool last_step_skipped(OptimizerRef optimizer) {
  return step_of(optimizer, "amp::last_step_skipped").last_step_skipped();
}

}  // namespace amp

namespace amp {

at::Tensor clip_grad_norm(OptimizerRef optimizer, double max_norm) {
  const auto context = detail::require_live_context("amp::clip_grad_norm");
  detail::OptimizerStep& step = context->require_step(optimizer.get(), "amp::clip_grad_norm");
  TORCH_CHECK(std::isfinite(max_norm) && max_norm > 0, "amp: clip_grad_norm needs a finite "
              "max_norm > 0, got ", max_norm, ".");
  TORCH_CHECK(step.state() != detail::OptimizerStep::State::kAccumulating, "amp: clip_grad_norm "
              "while the optimizer is ", detail::to_string(step.state()), ": its gradients are "
              "still scaled and held by amp. Clip after the last micro-batch's guard "
              "(delay_unscale=false).");
  std::vector<at::Tensor> grads;
  c10::Device device(c10::kCPU);
  for (const auto& group : step.optimizer().param_groups()) {
    for (const auto& p : group.params()) {
      device = p.device();
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  at::NoGradGuard no_grad;
  at::Tensor sum_of_squares = at::zeros({1}, at::TensorOptions(device).dtype(at::kFloat));
  if (!grads.empty()) {
    sum_of_squares = at::stack(at::_foreach_norm(grads, 2)).to(at::kFloat).pow(2).sum().reshape({1});
  }
  if (detail::ShardedMasters* sharded = context->sharded()) {  // the shards' squares add up
    std::vector<at::Tensor> tensors{sum_of_squares};
    sharded->group()->allreduce(tensors)->wait();
  }
  const at::Tensor total = sum_of_squares.sqrt().reshape({});
  if (!grads.empty()) at::_foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp_max(1.0));
  return total;
}

}  // namespace amp

namespace amp {

TrainingBytes training_bytes(const torch::optim::Optimizer& optimizer) {
  const auto context = detail::require_live_context("amp::training_bytes");
  detail::OptimizerStep& step = context->require_step(&optimizer, "amp::training_bytes");
  std::unordered_set<const void*> seen;
  auto bytes = [&](const at::Tensor& t) -> int64_t {
    if (!t.defined() || !seen.insert(t.storage().unsafeGetStorageImpl()).second) return 0;
    return static_cast<int64_t>(t.storage().nbytes());
  };
  TrainingBytes out;
  std::vector<at::Tensor> stepped;
  for (const auto& group : step.optimizer().param_groups()) {
    stepped.insert(stepped.end(), group.params().begin(), group.params().end());
  }
  for (const at::Tensor& p : stepped) out.masters += bytes(p);
  const detail::ShardedOptimizer* sharded_by = context->sharded() ? context->sharded()->of(optimizer) : nullptr;
  if (sharded_by != nullptr) {
    for (const at::Tensor& member : sharded_by->members()) out.weights += bytes(member);
  } else if (context->weights().mode() == detail::ModelWeights::Mode::kMasters) {
    std::unordered_set<const c10::TensorImpl*> steps(stepped.size());
    for (const at::Tensor& p : stepped) steps.insert(p.unsafeGetTensorImpl());
    for (const auto& e : context->weights().entries()) {
      if (steps.count(e.tensor.unsafeGetTensorImpl())) out.weights += bytes(e.compute);
    }
  }
  for (const auto& [key, state] : step.optimizer().state()) {
    int64_t count = 0;
    for (const detail::StateTensor& t : detail::state_tensors(*state, count)) out.optimizer_state += bytes(t.value);
  }
  for (const at::Tensor& p : stepped) out.gradients += bytes(p.grad());
  for (const at::Tensor& p : sharded_by ? sharded_by->members() : stepped) {
    out.gradients += bytes(p.grad());
    out.parameters += p.numel();
  }
  return out;
}

}  // namespace amp
