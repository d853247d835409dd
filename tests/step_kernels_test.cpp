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

#include <algorithm>
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

}  // namespace
}  // namespace amp::testing
