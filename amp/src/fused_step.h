// Private: torch::optim::Adam, AdamW and SGD stepped by ATen's fused
// kernels (_fused_adam_, _fused_adamw_, _fused_sgd_), which take the
// overflow flag and skip on the device, so no host read decides the step -
// what torch.amp does with fused optimizers.
//
// The algorithm and the optimizer state are LibTorch's: AdamParamState /
// AdamWParamState / SGDParamState in the optimizer's own state map, so
// checkpoints load into either path and into plain LibTorch. The kernels'
// arithmetic is ordered differently, so values agree with LibTorch's step
// within a few float32 rounding errors per step, not bit for bit. A skipped
// step changes nothing.
//
// Only the device knows whether a step was taken, so the host-side step
// counts (Adam's `step`) are brought up to date by settle() once the
// outcome reaches the host; the kernels read per-parameter step counts kept
// on the device. State a step creates (first moments, momentum buffers) is
// dropped again if that step turns out skipped, as LibTorch never creates
// it then; the next step waits for that outcome (on a GPU, once per run).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

namespace amp::detail {

// An optimizer's state, by the TensorImpl of its parameter.
using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;

class FusedStep {
 public:
  // Null when `optimizer` is not exactly torch::optim::Adam, AdamW or SGD
  // (a subclass may step differently).
  static std::unique_ptr<FusedStep> make(const torch::optim::Optimizer& optimizer);

  // Whether the kernels can step `groups` now: every gradient dense,
  // contiguous and of its parameter's dtype, float32 or float64, and every
  // parameter on one CPU or CUDA device.
  // The state of those parameters must be of the same dtype and contiguous.
  bool suits(const std::vector<torch::optim::OptimizerParamGroup>& groups,
             const StateMap& state) const;
  // Whether the outcome of a pending step must be known before the next
  // one (it created state that a skip must drop).
  bool awaits_outcome() const;

  // Steps the parameters with gradients, skipping on the device when
  // `found_inf` (1 element, exactly 0 or 1) is 1.
  void step(std::vector<torch::optim::OptimizerParamGroup>& groups,
            StateMap& state, const at::Tensor& found_inf);
  // The oldest pending step's outcome: counts its step or drops the state
  // it created.
  void settle(bool skipped, StateMap& state);
  // Forgets the device step counts (state was loaded or stepped unfused);
  // they are rebuilt from the state. No step may be pending.
  void reset();

 private:
  enum class Kind { kAdam, kAdamW, kSgd };
  explicit FusedStep(Kind kind) : kind_(kind) {}

  template <class Options, class ParamState>
  void step_adam(torch::optim::OptimizerParamGroup& group, StateMap& state,
                 const at::Tensor& found_inf, const at::Tensor& advance);
  void step_sgd(torch::optim::OptimizerParamGroup& group, StateMap& state,
                const at::Tensor& found_inf);
  template <class ParamState>
  void count_steps(const std::vector<void*>& stepped, StateMap& state);

  struct Attempt {
    std::vector<void*> stepped;  // Adam: whose step counts advance
    std::vector<void*> created;  // state created by this step
  };

  Kind kind_;
  std::unordered_map<void*, at::Tensor> device_steps_;  // Adam's step counts
  std::deque<Attempt> attempts_;  // pending steps, oldest first
};

}  // namespace amp::detail
