// Private: the gradient bookkeeping a MixedPrecisionOptimizer carries between
// scale_loss guards and step().
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <vector>

namespace amp::detail {

class Context;

// A model parameter and the tensor the optimizer steps for it: its fp32
// master at O2/O5, otherwise the parameter itself.
struct ParamPair {
  at::Tensor model;
  at::Tensor master;
  bool has_master() const { return !model.is_same(master); }
};

// One loss scaler update awaiting the host read that decides the next step.
struct PendingUpdate {
  at::Tensor snapshot;  // [found_inf, scale before, scale after] on the device
  int loss_id = 0;
  std::shared_ptr<Context> context;
  bool resolved = false;
  bool overflow = false;
  double scale_before = 0;
  double scale_after = 0;
};

struct OptimizerGradState {
  std::weak_ptr<Context> context;  // the initialization that made this optimizer
  bool master_weights = false;
  std::vector<ParamPair> params;  // every tensor the wrapped optimizer steps
  size_t group_param_count = 0;   // changes when add_param_group ran
  // Gradients already present when a guard started, kept aside during its
  // backward (aligned with params; undefined where none).
  std::vector<at::Tensor> stash;
  bool in_guard = false;
  // Set by delay_unscale: gradients hold values scaled by this loss's scaler.
  std::optional<int> scaled_by;
  std::vector<std::shared_ptr<PendingUpdate>> pending;
  int64_t skipped_steps = 0;

  // Builds pairs (and masters) for parameters added since the last call.
  void refresh(torch::optim::Optimizer& optimizer);
};

// Reads every unresolved update in `pending` with one host sync, logs skipped
// steps, and returns whether any overflowed. Clears `pending`.
bool resolve_pending(std::vector<std::shared_ptr<PendingUpdate>>& pending);

}  // namespace amp::detail
