// MixedPrecisionOptimizer: what amp::initialize returns in place of each
// optimizer. Existing code keeps calling optimizer->step(), zero_grad(),
// param_groups(), add_param_group() and torch::save/load on it.
//
// It takes over the wrapped optimizer's parameter groups and state and runs
// the wrapped optimizer's own algorithm on them. On top it
//   - skips step() after a gradient overflow (parameters and optimizer state
//     stay bit-identical). For torch::optim::Adam, AdamW and SGD with fp32
//     parameters or masters it steps with ATen's fused kernels, which take
//     the overflow flag and skip on the device: no host sync per step
//     (Options::fused_step; values agree with LibTorch's own step within a
//     few float32 roundings per step). Other optimizers run their own step
//     after one host read per step decided it;
//   - with master weights (O2/O5), keeps a float32 master for every
//     low-precision parameter: param_groups() hold the masters, the optimizer
//     state lives on them, and after each step they are copied back into the
//     model with fused multi-tensor ops. Clip gradients on
//     amp::master_params(optimizer), which are what is stepped.
//
// Gradients at O2/O5 (the full lifecycle table is in the guide): the model's
// low-precision .grad is scratch that each scale_loss guard moves into the
// fp32 master's .grad, summing over guards (several losses). step() uses the
// master gradients and then clears them, taken or skipped, as Apex does -
// model->zero_grad() cannot reach the masters, so loops that zero through the
// model, through the optimizer, or not at all train alike. Accumulate across
// steps with delay_unscale instead.
//
// Learning rates: LR schedulers work whether they were made on the original
// optimizer before amp::initialize (the usual order when adding amp to
// existing code) or on the returned one: at each step() a learning rate
// changed on either side is applied to the other. Other options and new
// parameter groups belong on the returned optimizer.
//
// Errors (c10::Error; nothing is changed):
//   - step(closure): closures re-run forward and backward inside step, which
//     amp's scale_loss guard cannot wrap; step without one;
//   - step() inside a live scale_loss guard, or while delay_unscale
//     accumulation is unfinished;
//   - step() with master weights when gradients exist only on the model's
//     low-precision parameters (backward ran outside amp::scale_loss);
//   - step() after a parameter group was added to the original optimizer
//     after initialize (add it to the returned optimizer).
// load() (torch::load(*optimizer, ...)) is all-or-nothing. Errors: a
// missing or mistyped master weight; any error of the wrapped optimizer's
// own load; a state tensor (momentum, Adam moments, ...) that is missing or
// whose shape, dtype or device differs from its parameter's; a numeric
// option (lr, betas, eps, ...) that is not a finite float32 value.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace amp {

namespace detail {
class Context;
class FusedStep;
class GradientLifecycle;
GradientLifecycle& lifecycle_of(const torch::optim::Optimizer& optimizer);
}  // namespace detail

// A low-precision model parameter and the float32 master the optimizer steps.
struct MasterWeight {
  at::Tensor parameter;
  at::Tensor master;
};

class MixedPrecisionOptimizer final : public torch::optim::Optimizer {
 public:
  // Made by amp::initialize. `fp32_originals` pairs converted model
  // parameters with their float32 values (from convert_model); with
  // `master_weights`, those become the masters and every other low-precision
  // parameter gets a float32 copy. `fused_step`: step Adam, AdamW and SGD
  // with the fused kernels where they apply.
  MixedPrecisionOptimizer(std::shared_ptr<torch::optim::Optimizer> wrapped, bool master_weights,
                          const std::vector<std::pair<at::Tensor, at::Tensor>>& fp32_originals,
                          std::shared_ptr<detail::Context> context, bool fused_step = true);
  ~MixedPrecisionOptimizer() override;

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // The optimizer whose algorithm runs. Between steps its groups hold this
  // optimizer's options without parameters (for schedulers made before
  // initialize) and its state is empty: stepping it directly does nothing.
  torch::optim::Optimizer& wrapped() const { return *wrapped_; }
  bool has_master_weights() const;
  // Every parameter that has a float32 master (empty without master weights).
  std::vector<MasterWeight> master_weights() const;

 private:
  friend detail::GradientLifecycle& detail::lifecycle_of(const torch::optim::Optimizer&);
  template <class Fn>
  void run_wrapped(Fn&& fn) const;
  void sync_learning_rates();
  // Waits for the outcome of fused steps the device decided, so that the
  // state's step counts are current.
  void settle_fused_steps() const;

  std::shared_ptr<torch::optim::Optimizer> wrapped_;
  std::unique_ptr<detail::GradientLifecycle> lifecycle_;
  std::unique_ptr<detail::FusedStep> fused_;  // null: the wrapped optimizer's own step
  // Each group's learning rate when last synced; empty when the options
  // have no learning rate (OptimizerOptions::get_lr not implemented).
  std::vector<double> synced_lrs_;
  size_t shadow_groups_ = 0;  // groups mirrored into the wrapped optimizer
};

// The tensors `optimizer` steps: float32 masters at O2/O5, the model's own
// parameters otherwise. Clip these (Apex's amp.master_params). Errors: an
// optimizer not returned by amp::initialize.
std::vector<at::Tensor> master_params(const torch::optim::Optimizer& optimizer);

// Steps of `optimizer` skipped after gradient overflows so far.
int64_t skipped_steps(const torch::optim::Optimizer& optimizer);

// Whether the latest step() of `optimizer` was skipped after an overflow.
// Advance an LR scheduler only when it was not:
//   optimizer->step();
//   if (!amp::last_step_skipped(*optimizer)) scheduler.step();
// After a fused step on a GPU both wait for the device's decision (a host
// sync, counted by amp::host_syncs()); ask only where the answer is needed.
bool last_step_skipped(const torch::optim::Optimizer& optimizer);

}  // namespace amp
