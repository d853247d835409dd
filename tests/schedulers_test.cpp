// SPDX-License-Identifier: BSD-3-Clause
// LR schedulers on the program's optimizer, made before or after
// amp::initialize, advanced after real steps only; parameter groups added
// after initialize.
#include "test_util.h"
#include <amp/internal/level_rules.h>

#include <torch/optim/schedulers/step_lr.h>

#include <limits>

namespace amp::testing {
namespace {


// --- Learning rate schedulers -----------------------------------------------

// One weight, loss = sum(w * c): the gradient is c, so each step moves w by
// exactly -lr * c and the learning rate in use can be read off the update.
struct LinearLossImpl : torch::nn::Module {
  LinearLossImpl() : w(register_parameter("w", torch::ones({4}))) {}
  torch::Tensor forward() { return (w * torch::tensor({1.0f, 2.0f, -1.0f, 0.5f})).sum(); }
  torch::Tensor w;
};
TORCH_MODULE(LinearLoss);

// Halves every group's learning rate on each step: a user's own scheduler.
class HalvingScheduler : public torch::optim::LRScheduler {
 public:
  using LRScheduler::LRScheduler;

 private:
  std::vector<double> get_lrs() override {
    auto lrs = get_current_lrs();
    for (double& lr : lrs) lr /= 2;
    return lrs;
  }
};

class SchedulerTest : public AmpTest, public ::testing::WithParamInterface<std::tuple<OptLevel, bool, bool>> {};

TEST_P(SchedulerTest, MadeBeforeOrAfterInitializeItDrivesTheSteppingOptimizer) {
  const auto [level, before_initialize, custom] = GetParam();
  auto make_scheduler = [custom = custom](torch::optim::Optimizer& o) -> std::unique_ptr<torch::optim::LRScheduler> {
    if (custom) return std::make_unique<HalvingScheduler>(o);
    return std::make_unique<torch::optim::StepLR>(o, /*step_size=*/1, /*gamma=*/0.5);
  };
  // Reference: plain LibTorch in float64, the same scheduler.
  LinearLoss reference;
  reference->to(torch::kDouble);
  torch::optim::SGD ref_optimizer(reference->parameters(), 0.5);
  auto ref_scheduler = make_scheduler(ref_optimizer);

  LinearLoss model;
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.5);
  std::unique_ptr<torch::optim::LRScheduler> scheduler;
  if (before_initialize) scheduler = make_scheduler(*optimizer);
  Options options = quiet(level);
  options.cpu_dtype = at::kHalf;  // every value here is exact in float16
  if (internal::resolve_properties(level, {}).loss_scale.dynamic) options.loss_scale = LossScale::Dynamic(4);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  if (!before_initialize) scheduler = make_scheduler(*optimizer);

  for (int it = 0; it < 5; ++it) {
    ref_optimizer.zero_grad();
    (reference->w * torch::tensor({1.0, 2.0, -1.0, 0.5}, torch::kDouble)).sum().backward();
    ref_optimizer.step();
    optimizer->zero_grad();
    {
      scale_loss scaled(model->forward(), optimizer);
      scaled.backward();
    }
    optimizer->step();
    const double lr = ref_optimizer.param_groups()[0].options().get_lr();
    EXPECT_TRUE(BitEqual(master_params(*optimizer)[0].to(torch::kDouble), reference->w)) << "step " << it << ", lr " << lr;
    EXPECT_EQ(optimizer->param_groups()[0].options().get_lr(), lr) << "step " << it;
    scheduler->step();
    ref_scheduler->step();
  }
  EXPECT_LT(ref_optimizer.param_groups()[0].options().get_lr(), 0.5) << "the schedule moved";
}

INSTANTIATE_TEST_SUITE_P(Levels, SchedulerTest,
                         ::testing::Combine(::testing::Values(O0, O1, O2, O3), ::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_MadeBefore" : "_MadeAfter") +
                                  (std::get<2>(info.param) ? "_Custom" : "_StepLR");
                         });

TEST_F(SchedulerTest, AdvancesOnlyAfterStepsThatHappened) {
  LinearLoss model;
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.5);
  HalvingScheduler scheduler(*optimizer);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
  for (int it = 0; it < 3; ++it) {
    optimizer->zero_grad();
    {
      scale_loss scaled(model->forward(), optimizer);
      scaled.backward();
      if (it == 1) model->w.grad()[0].fill_(kInf);
    }
    optimizer->step();
    if (!last_step_skipped(*optimizer)) scheduler.step();
  }
  EXPECT_EQ(optimizer->param_groups()[0].options().get_lr(), 0.125);  // two real steps
  EXPECT_EQ(skipped_steps(*optimizer), 1);
}

// A parameter group added after initialize (a layer unfrozen mid-run) is
// unscaled by the next guard and stepped at its own learning rate, at O2
// as float32 masters like the others.
TEST_F(SchedulerTest, GroupAddedAfterInitializeIsUnscaledAndStepped) {
  for (OptLevel level : {O1, O2}) {
    LinearLoss model, unfrozen;
    torch::optim::SGD optimizer(model->parameters(), 0.5);
    Options options = quiet(level);
    options.cpu_dtype = at::kHalf;  // every value here is exact in float16
    Handle handle;
    handle.initialize({model, unfrozen}, {optimizer}, options);
    optimizer.add_param_group(torch::optim::OptimizerParamGroup(
        unfrozen->parameters(), std::make_unique<torch::optim::SGDOptions>(0.25)));
    optimizer.zero_grad();
    {
      scale_loss scaled(model->forward() + unfrozen->forward(), optimizer);
      scaled.backward();
    }
    optimizer.step();
    const auto grads = torch::tensor({1.0f, 2.0f, -1.0f, 0.5f});
    EXPECT_TRUE(BitEqual(unfrozen->w.grad(), grads)) << to_string(level);
    EXPECT_TRUE(BitEqual(unfrozen->w, torch::ones({4}) - 0.25 * grads)) << to_string(level);
    EXPECT_TRUE(BitEqual(model->w, torch::ones({4}) - 0.5 * grads)) << to_string(level);
  }
}

}  // namespace
}  // namespace amp::testing
