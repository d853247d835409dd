// MixedPrecisionOptimizer: what amp::initialize returns in place of each
// optimizer. Existing code keeps calling optimizer->step(), zero_grad(),
// param_groups(), add_param_group() and torch::save/load on it.
//
// It takes over the wrapped optimizer's parameter groups and state (they move
// into this object, so step the returned optimizer, not the original one) and
// runs the wrapped optimizer's own algorithm on them. On top it
//   - skips step() after a gradient overflow (parameters and optimizer state
//     stay bit-identical), deciding with one host read per step;
//   - with master weights (O2/O5), keeps a float32 master for every
//     low-precision parameter: param_groups() hold the masters, the optimizer
//     state lives on them, and after each step they are copied back into the
//     model with fused multi-tensor ops. Clip gradients on
//     amp::master_params(optimizer), which are what is stepped.
//
// Errors: step(closure) (closures re-run forward and backward inside step,
// which amp's scale_loss guard cannot wrap; step without one).
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace amp {

namespace detail {
struct OptimizerGradState;
class Context;
}  // namespace detail

// A low-precision model parameter and the float32 master the optimizer steps.
struct MasterWeight {
  at::Tensor parameter;
  at::Tensor master;
};

class MixedPrecisionOptimizer final : public torch::optim::Optimizer {
 public:
  // `fp32_originals` maps converted model parameters to their float32 values
  // (from convert_model); with `master_weights`, those become the masters and
  // every other low-precision parameter gets a float32 copy.
  MixedPrecisionOptimizer(std::shared_ptr<torch::optim::Optimizer> wrapped, bool master_weights,
                          const std::vector<std::pair<at::Tensor, at::Tensor>>& fp32_originals,
                          std::shared_ptr<detail::Context> context);
  ~MixedPrecisionOptimizer() override;

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // The optimizer whose algorithm runs (its groups are empty between steps).
  torch::optim::Optimizer& wrapped() const { return *wrapped_; }
  bool has_master_weights() const;
  // Every parameter that has a float32 master (empty without master weights).
  std::vector<MasterWeight> master_weights() const;
  // Steps skipped after overflows so far.
  int64_t skipped_steps() const;

  // amp-internal: the gradient bookkeeping scale_loss drives.
  detail::OptimizerGradState& grad_state() const { return *grad_state_; }

 private:
  template <class Fn>
  void run_wrapped(Fn&& fn) const;

  std::shared_ptr<torch::optim::Optimizer> wrapped_;
  std::unique_ptr<detail::OptimizerGradState> grad_state_;
};

// The tensors `optimizer` steps: float32 masters at O2/O5, the model's own
// parameters otherwise. Clip these (Apex's amp.master_params). Errors: an
// optimizer not returned by amp::initialize.
std::vector<at::Tensor> master_params(const torch::optim::Optimizer& optimizer);

}  // namespace amp
