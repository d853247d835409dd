// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// amp::optim::FusedAdam, FusedAdamW and FusedSGD: LibTorch's Adam, AdamW and
/// SGD stepped by ATen's fused multi-tensor kernels (`_fused_adam_`,
/// `_fused_adamw_`, `_fused_sgd_`), as torch.optim's fused=True - Apex's
/// FusedAdam for C++.
///
/// ```
///   amp::optim::FusedAdam optimizer(model.parameters(), torch::optim::AdamOptions(1e-3));
///   amp::initialize(model, optimizer, amp::O2);
/// ```
///
/// Each is a torch::optim::Adam / AdamW / SGD: the same options, the same
/// state (AdamParamState, ...), the same checkpoints (torch::save of one
/// loads into the other), and usable wherever the program expects one. Only
/// step() differs: one kernel call per parameter group instead of about ten
/// ops per parameter, and under amp it takes the scale_loss guard's overflow
/// flag and skips on the device, so no host sync decides the step (GPU
/// training runs ahead of the host). A skipped step changes nothing.
///
/// Values agree with LibTorch's own step within a few float32 roundings per
/// step (the kernels order the arithmetic differently); plain SGD and AdamW
/// without amsgrad are bit-equal. Only the device knows whether a step was
/// taken, so the state's host step counts (Adam's `step`) are brought up to
/// date when the outcome reaches the host; checkpoints and
/// amp::last_step_skipped wait for it.
///
/// The kernels need every gradient dense and of its parameter's dtype and
/// parameters on one CPU or CUDA device; otherwise step() runs LibTorch's
/// own step (after one host read of a pending overflow flag). float16 and
/// bfloat16 parameters (O3) are stepped too, with their state in their own
/// dtype as LibTorch creates it, computed in float32 and rounded once (within
/// a few low-precision roundings of LibTorch's step, which rounds after
/// every op) - except FusedSGD's on the CPU, where ATen's kernel does not
/// update them and LibTorch's step runs.
///
/// Under amp with Options::optimizer_state_dtype = torch::kUInt8 the state
/// of parameters of 4096 elements or more is kept in 8 bits (blockwise,
/// docs/guide.md "8-bit optimizer state"): each step unpacks it into
/// float32 a chunk at a time, runs the kernel and packs the results again.
/// On CUDA, where amp was built with its kernels, these widened steps (O6's
/// bfloat16 weights and state, 8-bit state) run as one kernel instead: each
/// value decoded, stepped with ATen's fused Adam, AdamW or SGD arithmetic
/// and written back, with the same bits, no float32 copies, and one launch
/// for up to about 90 slices of 2^20 values.
/// A block of 256 values holding an inf or NaN (a moment that overflowed, a
/// NaN gradient under a static loss scale) is kept as NaN, never as finite
/// values: the next step is not finite, as it would be with float32 state.
///
/// With Properties::step_in_backward each parameter is stepped during the
/// guard's backward, alone, as soon as its gradient is final, and the
/// gradient freed; step() then applies nothing (docs/guide.md, "The step
/// inside backward").
///
/// A whole step (forward, scale_loss, step) can be captured in a CUDA graph
/// after warm-up steps; replays skip on the device and are counted there
/// (docs/guide.md, "A whole step in a CUDA graph").
///
/// Errors: those of the base class's step(); with 8-bit state, a step the
/// kernels cannot take (a sparse gradient, parameters on several devices),
/// which LibTorch's step cannot take either; inside a CUDA graph capture, a
/// step the graph could not replay: gradients the kernels cannot take, state
/// not yet created (no warm-up), a pending step's outcome the capture would
/// have to wait for, a verdict already read on the host, or a step that
/// rounds stochastically (O6, 8-bit state: a replay cannot draw fresh noise).
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <vector>

/// amp's optimizers: LibTorch's Adam, AdamW and SGD stepped by ATen's fused
/// kernels (fused.h).
namespace amp::optim {
namespace internal {

class FusedStepping;  // private: per-parameter device step counts
class FusedKernel;  // private: one optimizer's kernel calls

// What the three have in common (amp reads it; programs need not).
class Fused {
 public:
  virtual ~Fused();
  FusedStepping& stepping() { return *stepping_; }

 protected:
  explicit Fused(const FusedKernel& kernel);
  Fused(Fused&&) noexcept;
  // Steps `optimizer` (whose class this mixin belongs to) with the kernels;
  // false when they do not apply and the base class's step must run.
  bool fused_step(torch::optim::Optimizer& optimizer);
  // After either step: with Options::data_parallel.shard, all-gathers the
  // weights it changed now, on every rank (no forward needs a collective).
  static void stepped(const torch::optim::Optimizer& optimizer);
  // A step's closure, run first with gradients on, as LibTorch's step runs it.
  static at::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure);
  // Loaded state: the device step counts start again from its host ones.
  void reset_stepping();

 private:
  std::unique_ptr<FusedStepping> stepping_;
};

// LibTorch's optimizer classes amp fuses: each one's options, and its
// kernel (defined beside the kernel, amp/src/optim/fused_*_kernel.cpp).
template <class Base>
struct Fusable;
template <>
struct Fusable<torch::optim::Adam> {
  using Options = torch::optim::AdamOptions;
  static const FusedKernel& kernel();
};
template <>
struct Fusable<torch::optim::AdamW> {
  using Options = torch::optim::AdamWOptions;
  static const FusedKernel& kernel();
};
template <>
struct Fusable<torch::optim::SGD> {
  using Options = torch::optim::SGDOptions;  // no default: SGD needs a learning rate
  static const FusedKernel& kernel();
};
// LibTorch's `Base` (Adam, AdamW, SGD) stepped by ATen's fused kernel: the
// same constructors, options, state and checkpoints; step(closure) runs the
// closure first, as LibTorch's does.
template <class Base>
class FusedOptimizer : public Base, public Fused {
 public:
  using Options = typename Fusable<Base>::Options;
  explicit FusedOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                          Options defaults = {})
      : Base(param_groups, defaults), Fused(Fusable<Base>::kernel()) {}
  explicit FusedOptimizer(std::vector<at::Tensor> params, Options defaults = {})
      : Base(std::move(params), defaults), Fused(Fusable<Base>::kernel()) {}

  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    at::Tensor loss = run_closure(closure);
    if (!fused_step(*this)) Base::step();
    stepped(*this);
    return loss;
  }
  void load(torch::serialize::InputArchive& archive) override {
    Base::load(archive);
    reset_stepping();
  }
};

}  // namespace internal

// The three as types of their own, the names compilers and debuggers show.
/// torch::optim::Adam stepped by ATen's `_fused_adam_` kernel (see fused.h);
/// constructed as Adam is, from parameters or parameter groups and
/// torch::optim::AdamOptions.
class FusedAdam final : public internal::FusedOptimizer<torch::optim::Adam> {
 public:
  using FusedOptimizer::FusedOptimizer;
};
/// torch::optim::AdamW stepped by ATen's `_fused_adamw_` kernel (see fused.h);
/// constructed as AdamW is, from parameters or parameter groups and
/// torch::optim::AdamWOptions.
class FusedAdamW final : public internal::FusedOptimizer<torch::optim::AdamW> {
 public:
  using FusedOptimizer::FusedOptimizer;
};
/// torch::optim::SGD stepped by ATen's `_fused_sgd_` kernel (see fused.h);
/// constructed as SGD is, from parameters or parameter groups and
/// torch::optim::SGDOptions (which need a learning rate).
class FusedSGD final : public internal::FusedOptimizer<torch::optim::SGD> {
 public:
  using FusedOptimizer::FusedOptimizer;
};

}  // namespace amp::optim
