// SPDX-License-Identifier: BSD-3-Clause
// Loss scale sequences: scripted clean/overflow steps against values derived
// independently from the rules (Apex/GradScaler, Megatron hysteresis).
#include "test_util.h"

#include "optim/non_finite_check.h"

#include <torch/cuda.h>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>

namespace amp::testing {
namespace {

enum Step { kCleanStep, kInfStep, kNaNStep };

struct Expected {
  double scale;
  int64_t growth_tracker;
  int64_t hysteresis_tracker;
};

// The rules, written out plainly (not via amp or ATen).
std::vector<Expected> simulate(const std::vector<Step>& steps, double scale, const DynamicScaling& d) {
  const double floor = d.min_loss_scale.value_or(std::numeric_limits<float>::min());
  int64_t growth = 0, hysteresis = d.hysteresis;
  std::vector<Expected> out;
  for (Step step : steps) {
    if (step != kCleanStep) {
      growth = 0;
      hysteresis -= 1;
      if (hysteresis <= 0) scale = std::max(scale * d.backoff_factor, floor);
    } else if (++growth == d.growth_interval) {
      growth = 0;
      hysteresis = d.hysteresis;
      scale = std::min(scale * d.growth_factor, d.max_loss_scale);
    }
    out.push_back({scale, growth, hysteresis});
  }
  return out;
}

class ScaleSequenceTest : public AmpTest {
 protected:
  // Trains a one-layer model for `steps`, injecting inf/NaN into a gradient
  // inside the guard; returns the scaler state after each step.
  // `before_step(i)` runs before step i (to re-tune the scaler).
  std::vector<Expected> run(const std::vector<Step>& steps, double init, const DynamicScaling& d,
                            const std::function<void(size_t)>& before_step = nullptr) {
    auto model = torch::nn::Linear(3, 2);
    OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.01);
    Options options = quiet(O1);
    options.loss_scale = LossScale::Dynamic(init);
    options.dynamic_scaling = d;
    Handle handle;
    std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
    std::vector<Expected> out;
    for (Step step : steps) {
      if (before_step) before_step(out.size());
      optimizer->zero_grad();
      const auto loss = model(torch::randn({4, 3})).to(at::kFloat).mean();
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
        if (step == kInfStep) model->weight.grad()[0][1] = std::numeric_limits<float>::infinity();
        if (step == kNaNStep) model->bias.grad()[1] = std::numeric_limits<float>::quiet_NaN();
      }
      optimizer->step();
      const auto scaler = loss_scaler();
      out.push_back({scaler->scale(), scaler->growth_tracker(), scaler->hysteresis_tracker()});
    }
    return out;
  }

  void expect_sequence(const std::vector<Step>& steps, double init, const DynamicScaling& d) {
    const auto expected = simulate(steps, init, d);
    const auto actual = run(steps, init, d);
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t i = 0; i < steps.size(); ++i) {
      EXPECT_EQ(actual[i].scale, expected[i].scale) << "step " << i;
      EXPECT_EQ(actual[i].growth_tracker, expected[i].growth_tracker) << "step " << i;
      if (d.hysteresis > 1) {
        EXPECT_EQ(actual[i].hysteresis_tracker, expected[i].hysteresis_tracker) << "step " << i;
      }
    }
  }
};

TEST_F(ScaleSequenceTest, GrowthIntervalThree) {
  DynamicScaling d;
  d.growth_interval = 3;
  expect_sequence({kCleanStep, kCleanStep, kCleanStep, kInfStep, kCleanStep, kCleanStep, kCleanStep, kCleanStep, kNaNStep, kInfStep,
                   kCleanStep, kCleanStep, kCleanStep},
                  65536.0, d);
}

TEST_F(ScaleSequenceTest, GrowthIntervalOneCappedByMax) {
  DynamicScaling d;
  d.growth_interval = 1;
  d.max_loss_scale = 131072.0;
  expect_sequence({kCleanStep, kCleanStep, kCleanStep, kNaNStep, kCleanStep, kCleanStep, kInfStep, kInfStep, kCleanStep}, 65536.0, d);
}

TEST_F(ScaleSequenceTest, FloorHoldsAtMinLossScale) {
  DynamicScaling d;
  d.min_loss_scale = 16384.0;
  expect_sequence({kInfStep, kInfStep, kNaNStep, kInfStep, kCleanStep, kInfStep}, 65536.0, d);
}

TEST_F(ScaleSequenceTest, HysteresisTwoSkipsBeforeBackingOff) {
  DynamicScaling d;
  d.hysteresis = 2;
  d.growth_interval = 2;
  expect_sequence({kInfStep, kCleanStep, kInfStep, kInfStep, kCleanStep, kCleanStep, kInfStep, kCleanStep, kInfStep, kInfStep}, 1024.0, d);
}

TEST_F(ScaleSequenceTest, WithoutAFloorTheScaleNeverBecomesDenormalOrZero) {
  std::vector<Step> overflows(200, kInfStep);
  const auto states = run(overflows, 65536.0, DynamicScaling{});
  EXPECT_EQ(states.back().scale, static_cast<double>(std::numeric_limits<float>::min()));
  for (const auto& s : states) EXPECT_TRUE(std::isnormal(s.scale));
}

TEST_F(ScaleSequenceTest, RaiseAtTheFloorIsAClearError) {
  auto model = torch::nn::Linear(3, 2);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.01);
  Options options = quiet(O1);
  options.dynamic_scaling.min_loss_scale = 32768.0;
  options.dynamic_scaling.at_floor = DynamicScaling::AtFloor::kRaise;
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  auto overflow_step = [&](bool finish) {
    optimizer->zero_grad();
    {
      scale_loss scaled(model(torch::randn({2, 3})).to(at::kFloat).sum(), optimizer);
      scaled.backward();
      model->bias.grad()[0] = std::numeric_limits<float>::infinity();
      if (finish) scaled.finish();  // errors raised here
    }
    optimizer->step();
  };
  overflow_step(false);  // 65536 -> 32768, the floor
  EXPECT_EQ(loss_scale(), 32768.0);
  EXPECT_AMP_ERROR(overflow_step(true), "already at its floor");
  EXPECT_EQ(loss_scale(), 32768.0);
  EXPECT_FALSE(model->bias.grad().defined()) << "the step was skipped";
  // Without finish(), the guard's end cannot throw; the next guard raises it.
  overflow_step(false);
  EXPECT_FALSE(model->bias.grad().defined());
  const auto loss = model(torch::randn({2, 3})).sum();
  EXPECT_AMP_ERROR(scale_loss(loss, optimizer), "already at its floor");
  { scale_loss scaled(loss, optimizer); }  // raised once
}

// A fused optimizer takes the verdict on the device: the guard does not read
// it, so its step() raises the floor error, after skipping on the device.
TEST_F(ScaleSequenceTest, RaiseAtTheFloorWithAFusedOptimizerIsRaisedByItsStep) {
  auto model = torch::nn::Linear(3, 2);
  amp::optim::FusedSGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  Options options = quiet(O1);
  options.dynamic_scaling.min_loss_scale = 32768.0;
  options.dynamic_scaling.at_floor = DynamicScaling::AtFloor::kRaise;
  Handle handle;
  handle.initialize(model, optimizer, options);
  auto overflow_guard = [&] {
    optimizer.zero_grad();
    scale_loss scaled(model(torch::randn({2, 3})).sum(), optimizer);
    scaled.backward();
    model->bias.grad()[0] = std::numeric_limits<float>::infinity();
    scaled.finish();
  };
  overflow_guard();
  optimizer.step();  // 65536 -> 32768, the floor
  const auto weight = model->weight.clone();
  overflow_guard();  // the guard leaves the verdict to the step
  EXPECT_AMP_ERROR(optimizer.step(), "already at its floor");
  EXPECT_EQ(loss_scale(), 32768.0);
  EXPECT_TRUE(BitEqual(model->weight, weight)) << "the step was skipped";
  EXPECT_EQ(skipped_steps(optimizer), 2);
  optimizer.zero_grad();
  {
    scale_loss scaled(model(torch::randn({2, 3})).sum(), optimizer);  // raised once: training goes on
    scaled.backward();
  }
  optimizer.step();
  EXPECT_FALSE(BitEqual(model->weight, weight));
}

TEST_F(ScaleSequenceTest, KnobsChangedWhileTrainingApplyFromTheNextUpdate) {
  DynamicScaling first;
  first.growth_interval = 3;
  DynamicScaling second = first;
  second.growth_factor = 4.0;
  second.backoff_factor = 0.25;
  second.growth_interval = 2;
  // Changed right after an overflow, where both trackers restart: the two
  // halves follow the rules with their own knobs.
  const std::vector<Step> head = {kCleanStep, kCleanStep, kCleanStep, kCleanStep, kInfStep};
  const std::vector<Step> tail = {kCleanStep, kCleanStep, kCleanStep, kInfStep, kCleanStep, kCleanStep, kNaNStep};
  std::vector<Expected> expected = simulate(head, 65536.0, first);
  for (const Expected& e : simulate(tail, expected.back().scale, second)) expected.push_back(e);
  std::vector<Step> steps = head;
  steps.insert(steps.end(), tail.begin(), tail.end());
  const auto actual = run(steps, 65536.0, first, [&](size_t step) {
    if (step != head.size()) return;
    loss_scaler()->set_growth_factor(4.0);
    loss_scaler()->set_backoff_factor(0.25);
    loss_scaler()->set_growth_interval(2);
    EXPECT_EQ(loss_scaler()->dynamic_scaling().growth_interval, 2);
  });
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(actual[i].scale, expected[i].scale) << "step " << i;
    EXPECT_EQ(actual[i].growth_tracker, expected[i].growth_tracker) << "step " << i;
  }
}

TEST_F(ScaleSequenceTest, BadKnobsAreRefusedAndChangeNothing) {
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  const auto scaler = loss_scaler();
  EXPECT_AMP_ERROR(scaler->set_growth_factor(1.0), "growth_factor must be > 1");
  EXPECT_AMP_ERROR(scaler->set_backoff_factor(1.5), "backoff_factor must lie in (0, 1)");
  EXPECT_AMP_ERROR(scaler->set_growth_interval(0), "growth_interval must be >= 1");
  DynamicScaling bad;
  bad.min_loss_scale = 1e9;
  EXPECT_AMP_ERROR(scaler->set_dynamic_scaling(bad), "must not exceed max_loss_scale");
  const DynamicScaling defaults;
  EXPECT_EQ(scaler->dynamic_scaling().growth_factor, defaults.growth_factor);
  EXPECT_EQ(scaler->dynamic_scaling().backoff_factor, defaults.backoff_factor);
  EXPECT_EQ(scaler->dynamic_scaling().growth_interval, defaults.growth_interval);
  EXPECT_FALSE(scaler->dynamic_scaling().min_loss_scale.has_value());
  handle.deinitialize();
  Options fixed = quiet(O1);
  fixed.loss_scale = LossScale::Static(128.0);
  handle.initialize(std::vector<ModulePtr>{}, {}, fixed);
  EXPECT_AMP_ERROR(loss_scaler()->set_growth_factor(4.0), "static scale");
}

// The scaler a program keeps stays valid when amp ends: it reads the final
// scale; the next initialization has scalers of its own.
TEST_F(ScaleSequenceTest, AKeptScalerOutlivesItsInitialization) {
  auto model = torch::nn::Linear(3, 2);
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  std::shared_ptr<LossScaler> kept;
  {
    Handle handle;
    handle.initialize(model, optimizer, quiet(O1));
    kept = loss_scaler();
    optimizer.zero_grad();
    {
      scale_loss scaled(model(torch::randn({2, 3})).sum(), optimizer);
      scaled.backward();
      model->bias.grad()[0] = std::numeric_limits<float>::infinity();
    }
    optimizer.step();
  }  // amp ends; its context is gone
  EXPECT_FALSE(is_initialized());
  EXPECT_AMP_ERROR(loss_scaler(), "needs amp to be initialized");
  EXPECT_EQ(kept->scale(), 32768.0);
  kept->set_growth_interval(5);  // a finished run's knobs: harmless
  Handle next;
  next.initialize(model, optimizer, quiet(O1));
  EXPECT_NE(loss_scaler(), kept);
  EXPECT_EQ(loss_scale(), 65536.0);
  EXPECT_EQ(loss_scaler()->dynamic_scaling().growth_interval, 2000);
}

TEST_F(ScaleSequenceTest, KnobsTravelWithAmpsStateAndOldStatesKeepTheCurrentOnes) {
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  DynamicScaling tuned;
  tuned.growth_factor = 3.0;
  tuned.backoff_factor = 0.125;
  tuned.growth_interval = 7;
  tuned.hysteresis = 2;
  tuned.min_loss_scale = 4.0;
  tuned.max_loss_scale = 1e6;
  tuned.at_floor = DynamicScaling::AtFloor::kRaise;
  loss_scaler()->set_dynamic_scaling(tuned);
  torch::serialize::OutputArchive out;
  save_state(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  handle.deinitialize();

  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  load_state_bytes(bytes.str());
  const DynamicScaling& loaded = loss_scaler()->dynamic_scaling();
  EXPECT_EQ(loaded.growth_factor, 3.0);
  EXPECT_EQ(loaded.backoff_factor, 0.125);
  EXPECT_EQ(loaded.growth_interval, 7);
  EXPECT_EQ(loaded.hysteresis, 2);
  EXPECT_EQ(loaded.min_loss_scale, 4.0);
  EXPECT_EQ(loaded.max_loss_scale, 1e6);
  EXPECT_EQ(loaded.at_floor, DynamicScaling::AtFloor::kRaise);

  // A state written before the knobs were saved: the scale loads, the
  // current knobs stay.
  torch::serialize::OutputArchive old_scaler;
  for (const char* key : {"scale", "growth_tracker", "hysteresis_tracker", "dynamic"}) {
    torch::serialize::InputArchive in;
    std::istringstream again(bytes.str());
    in.load_from(again);
    torch::serialize::InputArchive scaler;
    ASSERT_TRUE(in.try_read("loss_scaler0", scaler));
    at::Tensor value;
    ASSERT_TRUE(scaler.try_read(key, value));
    old_scaler.write(key, std::string(key) == "scale" ? torch::full({1}, 512.0f) : value);
  }
  torch::serialize::OutputArchive old_state;
  old_state.write("opt_level", c10::IValue(std::string("O1")));
  old_state.write("num_losses", torch::scalar_tensor(int64_t{1}, at::kLong));
  old_state.write("loss_scaler0", old_scaler);
  std::ostringstream old_bytes;
  old_state.save_to(old_bytes);
  handle.deinitialize();
  Options defaults_but_interval = quiet(O1);
  defaults_but_interval.dynamic_scaling.growth_interval = 11;
  handle.initialize(std::vector<ModulePtr>{}, {}, defaults_but_interval);
  load_state_bytes(old_bytes.str());
  EXPECT_EQ(loss_scale(), 512.0);
  EXPECT_EQ(loss_scaler()->dynamic_scaling().growth_interval, 11);
  EXPECT_EQ(loss_scaler()->dynamic_scaling().growth_factor, 2.0);
}

TEST_F(ScaleSequenceTest, StaticScaleNeverChangesNorSkips) {
  auto model = torch::nn::Linear(3, 1);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.5);
  Options options = quiet(O1);
  options.loss_scale = LossScale::Static(128.0);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  const int64_t syncs = host_syncs();
  for (int i = 0; i < 3; ++i) {
    const auto before = model->weight.clone();
    optimizer->zero_grad();
    {
      scale_loss scaled(model(torch::randn({2, 3})).to(at::kFloat).sum(), optimizer);
      scaled.backward();
      if (i == 1) model->bias.grad().fill_(std::numeric_limits<float>::infinity());  // an overflow
    }
    optimizer->step();
    EXPECT_EQ(loss_scale(), 128.0) << "step " << i;
    EXPECT_FALSE(last_step_skipped(*optimizer)) << "step " << i;
    EXPECT_FALSE(torch::equal(before, model->weight)) << "step " << i << " was taken";
  }
  EXPECT_FALSE(torch::isfinite(model->bias).all().item<bool>()) << "the overflowed step was applied, as Apex does";
  EXPECT_EQ(skipped_steps(*optimizer), 0);
  EXPECT_EQ(host_syncs(), syncs);  // nothing to decide: no host read
}

// Optimizers without a fused kernel (fused_step_test.cpp has those).
TEST_F(ScaleSequenceTest, OneHostSyncPerStep) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::RMSprop>(model->parameters(), 1e-3);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
  for (int step = 0; step < 5; ++step) {
    const int64_t before = host_syncs();
    optimizer->zero_grad();
    {
      scale_loss scaled(model->forward(torch::randn({4, 8})).to(at::kFloat).sum(), optimizer);
      scaled.backward();
    }
    optimizer->step();
    EXPECT_EQ(host_syncs() - before, 1);
  }
}

// ATen's CUDA kernel for the inf/NaN check and unscale takes no bfloat16
// gradients (O5, O6, bfloat16 shards); amp's replacement must find every inf
// and NaN and write, bit for bit, what ATen's kernel writes on the CPU - with
// a factor bfloat16 cannot hold (1/1000), and a 0-dim gradient among them.
void ExpectBFloat16FallbackMatchesATen(c10::Device device) {
  const float kInfStep = std::numeric_limits<float>::infinity();
  torch::manual_seed(0);
  const std::vector<at::Tensor> reference = {torch::randn({37, 5}) * 1e3, torch::randn({}) * 7,
                                             torch::randn({300}) * 1e-3};
  const at::Tensor inv_scale = torch::full({1}, 1.0 / 1000.0);
  for (const float poison : {0.0f, kInfStep, -kInfStep, std::nanf("")}) {
    SCOPED_TRACE("poison " + std::to_string(poison));
    std::vector<at::Tensor> aten, ours;
    for (const auto& g : reference) {
      aten.push_back(g.to(at::kBFloat16));
      ours.push_back(g.to(device, at::kBFloat16));
    }
    if (poison != 0.0f) {
      aten[2][17] = poison;
      ours[2][17] = poison;
    }
    at::Tensor aten_found = torch::zeros({1}), ours_found = torch::zeros({1}, device);
    at::_amp_foreach_non_finite_check_and_unscale_(aten, aten_found, inv_scale);
    detail::check_and_unscale_by_max(ours, ours_found, inv_scale.to(device));
    EXPECT_EQ(ours_found.item<float>(), poison == 0.0f ? 0.0f : 1.0f);
    EXPECT_TRUE(BitEqual(ours_found.cpu(), aten_found));
    for (size_t i = 0; i < aten.size(); ++i) {
      // NaN times anything is NaN, whose sign and payload the device chooses.
      const at::Tensor mine = ours[i].cpu();
      EXPECT_TRUE(torch::equal(mine.isnan(), aten[i].isnan())) << "gradient " << i;
      EXPECT_TRUE(BitEqual(mine.nan_to_num(0), aten[i].nan_to_num(0))) << "gradient " << i;
    }
  }
}

// The unscale multiplies by float32's reciprocal of the scale, where
// GradScaler takes the double reciprocal rounded to float: the same float
// for any float32 scale (loss_scaler.cpp says why; all 2^31 positive
// scales were checked once). Here 2^22 random scales over every exponent,
// subnormals and powers of two among them.
TEST(InverseScale, Float32ReciprocalIsGradScalersDoubleReciprocal) {
  torch::manual_seed(4);
  const at::Tensor bits = torch::cat({torch::randint(1, 0x7F800000, {1 << 22}, at::kInt),
                                      torch::arange(0, 255, at::kInt).mul_(1 << 23).add_(1 << 23).clamp_max_(0x7F000000)});
  const at::Tensor scale = bits.view(at::kFloat);
  const at::Tensor ours = scale.reciprocal(), grad_scaler = scale.to(at::kDouble).reciprocal().to(at::kFloat);
  EXPECT_EQ(ours.view(at::kInt).ne(grad_scaler.view(at::kInt)).sum().item<int64_t>(), 0);
}

TEST(BFloat16UnscaleFallback, MatchesATensKernelOnTheCpu) { ExpectBFloat16FallbackMatchesATen(torch::kCPU); }

TEST(CudaBFloat16Unscale, MatchesATensCpuKernelOnTheDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  ExpectBFloat16FallbackMatchesATen(torch::kCUDA);
}

}  // namespace
}  // namespace amp::testing
