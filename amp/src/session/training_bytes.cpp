// SPDX-License-Identifier: BSD-3-Clause
// amp::training_bytes (distributed.h): what an optimizer's training holds,
// read across the layers - masters, lowered or sharded weights, state,
// gradients.
#include <amp/memory.h>

#include "optim/optimizer_kinds.h"
#include "session/context.h"

#include <unordered_set>
#include <vector>

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
