// SPDX-License-Identifier: BSD-3-Clause
// What amp's step runs - the unscale and check as scale_loss exits, and the
// fused optimizers' step - does not grow with the number of parameter
// tensors: a model of 100 tensors runs as many ops that compute as one of
// 10 tensors of the same size, at every level, with the widened steps (O6's
// rounding, 8-bit state) too. On a GPU each of those ops is a kernel launch
// or a few, so a model of many small tensors pays no launches per tensor.
#include "test_util.h"

#include "profiled.h"

#include <amp/fused.h>
#include <amp/optimizer.h>

#ifdef AMP_TEST_CUDA_KERNELS
#include "optim/widened_step_kernels.h"
#endif

#include <algorithm>
#include <iostream>
#include <limits>
#include <map>
#include <string>

namespace amp::testing {
namespace {

// `count` parameter vectors of `total` values together; the loss reads them all.
struct ManyTensorsImpl : torch::nn::Module {
  ManyTensorsImpl(int64_t count, int64_t total) {
    torch::manual_seed(3);
    for (int64_t i = 0; i < count; ++i) {
      params.push_back(register_parameter("p" + std::to_string(i), torch::randn({total / count}) * 0.1));
    }
  }
  at::Tensor loss() const { return at::cat(params).to(at::kFloat).square().sum(); }
  std::vector<at::Tensor> params;
};
TORCH_MODULE(ManyTensors);

// Ops that make a view or read metadata: no kernel on any device, a few
// hundred nanoseconds of the host's each.
bool computes(const std::string& name) {
  static const std::set<std::string> metadata{"aten::view", "aten::narrow", "aten::slice", "aten::as_strided",
                                              "aten::_has_compatible_shallow_copy_type"};
  return !metadata.count(name);
}

// The ops that compute among those `fn` calls itself (not the ones they
// call in turn), by name: what a GPU would launch.
std::map<std::string, int> computing_ops(const std::function<void()>& fn) {
  struct Op {
    int64_t start, end;
    std::string name;
  };
  std::vector<Op> ops;
  for (const auto& e : profiled(fn)) {
    if (e.name().rfind("aten::", 0) == 0) ops.push_back({int64_t(e.startNs()), int64_t(e.endNs()), e.name()});
  }
  std::sort(ops.begin(), ops.end(), [](const Op& a, const Op& b) {
    return a.start != b.start ? a.start < b.start : a.end > b.end;  // an op before those inside it
  });
  std::map<std::string, int> outermost;
  int64_t open_until = -1;
  for (const Op& op : ops) {
    if (op.start < open_until) continue;  // inside the last outermost op
    open_until = op.end;
    if (computes(op.name)) ++outermost[op.name];
  }
  return outermost;
}

struct StepOps {
  std::map<std::string, int> exit, step;  // scale_loss's exit, optimizer.step()
};

template <class Optimizer, class OptimizerOptions>
StepOps step_ops(Options options, const OptimizerOptions& optimizer_options, int64_t count) {
  ManyTensors model(count, 409600);  // 100 tensors of 4096: the smallest that 8-bit state packs
  Optimizer optimizer(model->parameters(), optimizer_options);
  options.verbosity = 0;
  Handle handle;
  handle.initialize(model, optimizer, options);
  StepOps ops;
  for (int step = 0; step < 3; ++step) {  // the third step's: the state made, the caches warm
    optimizer.zero_grad();
    std::optional<scale_loss> scaled(std::in_place, model->loss(), optimizer);
    scaled->backward();
    ops.exit = computing_ops([&] { scaled.reset(); });
    ops.step = computing_ops([&] { optimizer.step(); });
  }
  return ops;
}

int total(const std::map<std::string, int>& ops) {
  int n = 0;
  for (const auto& [name, count] : ops) n += count;
  return n;
}

std::string listed(const std::map<std::string, int>& ops) {
  std::string text;
  for (const auto& [name, count] : ops) text += " " + name + " x" + std::to_string(count);
  return text;
}

class StepKernelsTest : public ::testing::TestWithParam<LevelCase> {
 protected:
  template <class Optimizer, class OptimizerOptions>
  void expect_the_same_ops(Options options, const OptimizerOptions& optimizer_options, const char* fused_op) {
    const StepOps few = step_ops<Optimizer>(options, optimizer_options, 10);
    const StepOps many = step_ops<Optimizer>(options, optimizer_options, 100);
    EXPECT_EQ(few.exit, many.exit) << "10 tensors:" << listed(few.exit) << "\n100 tensors:" << listed(many.exit);
    EXPECT_EQ(few.step, many.step) << "10 tensors:" << listed(few.step) << "\n100 tensors:" << listed(many.step);
    // The step is the fused kernel's: once, not LibTorch's step per tensor.
    EXPECT_EQ(many.step.count(fused_op) ? many.step.at(fused_op) : 0, 1) << listed(many.step);
    EXPECT_LE(total(many.exit) + total(many.step), 30) << listed(many.exit) << listed(many.step);
  }
};

TEST_P(StepKernelsTest, FusedAdamWRunsAsManyOpsForManyTensorsAsForFew) {
  expect_the_same_ops<amp::optim::FusedAdamW>(GetParam().options(), torch::optim::AdamWOptions(1e-3),
                                              "aten::_fused_adamw_");
}

TEST_P(StepKernelsTest, FusedSgdWithMomentumRunsAsManyOpsForManyTensorsAsForFew) {
  if (GetParam().name.rfind("O3", 0) == 0) {
    GTEST_SKIP() << "on the CPU FusedSGD steps O3's low-precision weights with LibTorch's step, a tensor at a "
                    "time: ATen 2.11's CPU _fused_sgd_ does not update them (fused.h)";
  }
  expect_the_same_ops<amp::optim::FusedSGD>(GetParam().options(), torch::optim::SGDOptions(0.1).momentum(0.9),
                                            "aten::_fused_sgd_");
}

TEST_P(StepKernelsTest, EightBitStateRunsAsManyOpsForManyTensorsAsForFew) {
  if (GetParam().name.rfind("O3", 0) == 0) {
    GTEST_SKIP() << "O3 steps its low-precision weights as they are; initialize refuses 8-bit state there";
  }
  Options options = GetParam().options();
  options.optimizer_state_dtype = at::kByte;
  expect_the_same_ops<amp::optim::FusedAdamW>(options, torch::optim::AdamWOptions(1e-3), "aten::_fused_adamw_");
  expect_the_same_ops<amp::optim::FusedSGD>(options, torch::optim::SGDOptions(0.1).momentum(0.9),
                                            "aten::_fused_sgd_");
}

INSTANTIATE_TEST_SUITE_P(Levels, StepKernelsTest, every_level(), level_case_name);

// ---- On CUDA: the widened Adam step as one kernel -------------------------

// Tensors at the fused kernel's edges: 1.1M values (two slices of the
// chunked path's 2^20), rows of 256 cut short, a tensor of 3.
struct EdgesImpl : torch::nn::Module {
  EdgesImpl() {
    torch::manual_seed(5);
    big = register_parameter("big", torch::randn({1100, 1000}) * 0.02);
    mid = register_parameter("mid", torch::randn({4100}) * 0.1);
    small = register_parameter("small", torch::randn({3}));
  }
  at::Tensor loss(const at::Tensor& x) const {
    return big.to(at::kFloat).matmul(x).square().mean() + mid.to(at::kFloat).square().sum() +
           small.to(at::kFloat).pow(3).sum();
  }
  at::Tensor big, mid, small;
};
TORCH_MODULE(Edges);

struct WidenedRun {
  std::vector<at::Tensor> params, state;
  int64_t step_kernels = 0, fused_launches = 0;  // the fourth step's kernels, and the fused one's
  int64_t skipped = 0;
};

// Five steps of `Optimizer` on CUDA at `options`, the third overflowing
// (skipped on the device), through the fused kernel or the chunked path;
// the fourth step's kernels counted by LibTorch's profiler.
template <class Optimizer, class ParamState, class OptimizerOptions>
WidenedRun widened_run(Options options, const OptimizerOptions& optimizer_options, bool fused) {
#ifdef AMP_TEST_CUDA_KERNELS
  detail::set_widened_steps_fused(fused);
#endif
  Edges model;
  model->to(torch::kCUDA);
  Optimizer optimizer(model->parameters(), optimizer_options);
  options.loss_scale = LossScale::Dynamic();
  options.verbosity = 0;
  Handle handle;
  handle.initialize(model, optimizer, options);
  torch::manual_seed(6);
  const at::Tensor x = torch::randn({1000, 4}, torch::kCUDA);
  WidenedRun run;
  for (int step = 0; step < 5; ++step) {
    optimizer.zero_grad();
    const at::Tensor loss = model->loss(x) * (step == 2 ? std::numeric_limits<float>::infinity() : 1.0f);
    scale_loss(loss, optimizer).backward();
    if (step != 3) {
      optimizer.step();
      continue;
    }
    namespace profiler = torch::autograd::profiler;
    const profiler::ProfilerConfig config(profiler::ProfilerState::KINETO);
    const std::set<torch::profiler::impl::ActivityType> cuda{torch::profiler::impl::ActivityType::CUDA};
    profiler::prepareProfiler(config, cuda);
    profiler::enableProfiler(config, cuda);
    optimizer.step();
    torch::cuda::synchronize();
    for (const auto& e : profiler::disableProfiler()->events()) {
      ++run.step_kernels;
      const std::string& name = e.name();
      const bool fused_kernel = name.find("adam_kernel") != std::string::npos || name.find("sgd_kernel") != std::string::npos;
      if (name.find("widened_step") != std::string::npos && fused_kernel) ++run.fused_launches;
    }
  }
#ifdef AMP_TEST_CUDA_KERNELS
  detail::set_widened_steps_fused(true);
#endif
  run.skipped = skipped_steps(optimizer);
  for (const at::Tensor& p : optimizer.param_groups()[0].params()) {  // O2, O5: the float32 masters
    run.params.push_back(p.detach().clone());
    auto entry = optimizer.state().find(p.unsafeGetTensorImpl());
    if (entry == optimizer.state().end()) continue;  // SGD without momentum keeps none
    const auto& s = static_cast<const ParamState&>(*entry->second);
    if constexpr (std::is_same_v<ParamState, torch::optim::SGDParamState>) {
      run.state.push_back(s.momentum_buffer());
    } else {
      run.state.insert(run.state.end(), {torch::tensor(s.step()), s.exp_avg(), s.exp_avg_sq()});
      if (s.max_exp_avg_sq().defined()) run.state.push_back(s.max_exp_avg_sq());
    }
  }
  return run;
}

// The runs of one optimizer through both paths, compared.
template <class Optimizer, class ParamState, class OptimizerOptions>
void expect_one_kernel_as_chunked(const std::string& what, const Options& options, const OptimizerOptions& o) {
  SCOPED_TRACE(what);
  const WidenedRun fused = widened_run<Optimizer, ParamState>(options, o, true);
  const WidenedRun chunked = widened_run<Optimizer, ParamState>(options, o, false);
  EXPECT_EQ(fused.skipped, 1);
  EXPECT_EQ(chunked.skipped, 1);
  EXPECT_TRUE(AllBitEqual(fused.params, chunked.params));
  EXPECT_TRUE(AllBitEqual(fused.state, chunked.state));
  // The steps moved the weights: the comparison is not of untouched tensors.
  Edges start;
  EXPECT_FALSE(BitEqual(fused.params[0].cpu(), start->big.to(fused.params[0].scalar_type())));
  if (chunked.step_kernels == 0) {  // CUPTI taken, as under compute-sanitizer
    std::cout << "[   NOTE   ] the profiler saw no kernels: " << what << ": launches not counted\n";
    return;
  }
  EXPECT_EQ(fused.fused_launches, 1);
  EXPECT_EQ(chunked.fused_launches, 0);
  EXPECT_LT(fused.step_kernels, chunked.step_kernels);
  std::cout << "[   NOTE   ] " << what << ": " << fused.step_kernels << " kernels a step in one, "
            << chunked.step_kernels << " chunked\n";
}

// The fused kernels write the chunked path's bits - widened copies, ATen's
// _fused_adam(w)_ or _fused_sgd_, then amp's rounding and coding kernels -
// for O6's bfloat16 weights and state, 8-bit state at O5 and O6: Adam with
// L2 and AMSGrad, AdamW with decoupled decay, SGD with momentum (Nesterov's,
// dampened) and without, through a skipped step; in one launch where the
// chunked path takes five a chunk.
TEST(WidenedStepTest, OnCudaOneKernelStepsAsTheChunkedPathBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
#ifndef AMP_TEST_CUDA_KERNELS
  GTEST_SKIP() << "this build has no CUDA kernels (no CUDA compiler): the chunked path steps widened parameters";
#endif
  Options o6_packed = O6, o5_packed = O5;
  o6_packed.optimizer_state_dtype = o5_packed.optimizer_state_dtype = at::kByte;
  const std::vector<std::pair<std::string, Options>> levels = {{"O6", O6}, {"O6 + 8-bit state", o6_packed},
                                                              {"O5 + 8-bit state", o5_packed}};
  for (const auto& [name, options] : levels) {
    using torch::optim::SGDOptions;
    expect_one_kernel_as_chunked<amp::optim::FusedAdam, torch::optim::AdamParamState>(
        name + ", Adam", options, torch::optim::AdamOptions(1e-3).weight_decay(0.01).amsgrad(true));
    expect_one_kernel_as_chunked<amp::optim::FusedAdamW, torch::optim::AdamWParamState>(
        name + ", AdamW", options, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    expect_one_kernel_as_chunked<amp::optim::FusedSGD, torch::optim::SGDParamState>(
        name + ", SGD with Nesterov momentum", options, SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01));
    expect_one_kernel_as_chunked<amp::optim::FusedSGD, torch::optim::SGDParamState>(
        name + ", SGD with dampened momentum", options, SGDOptions(0.05).momentum(0.9).dampening(0.1));
    expect_one_kernel_as_chunked<amp::optim::FusedSGD, torch::optim::SGDParamState>(
        name + ", SGD", options, SGDOptions(0.05).weight_decay(0.01));
  }
}

}  // namespace
}  // namespace amp::testing
