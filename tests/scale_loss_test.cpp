// SPDX-License-Identifier: BSD-3-Clause
// The scale_loss guard: skipped steps, logs, several losses and optimizers,
// accumulation, clipping, gradient penalty, misuse.
#include "test_util.h"

#include <torch/csrc/autograd/custom_function.h>

#include <limits>
#include <sstream>

namespace amp::testing {
namespace {


std::string serialized(const torch::optim::Optimizer& optimizer) {
  std::ostringstream bytes;
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  archive.save_to(bytes);
  return bytes.str();
}

using OptimizerFactory = std::function<OptimizerPtr(std::vector<at::Tensor>)>;

struct NamedFactory {
  std::string name;
  OptimizerFactory make;
};

class SkippedStepTest : public AmpTest, public ::testing::WithParamInterface<NamedFactory> {};

TEST_P(SkippedStepTest, OverflowLeavesParametersAndOptimizerStateBitIdentical) {
  auto model = TinyNet();
  OptimizerPtr optimizer = GetParam().make(model->parameters());
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
  auto iteration = [&](bool overflow) {
    optimizer->zero_grad();
    {
      scale_loss scaled(model->forward(torch::randn({4, 8})).to(at::kFloat).pow(2).mean(), optimizer);
      scaled.backward();
      if (overflow) model->fc2->weight.grad()[0][0] = kInf;
    }
    optimizer->step();
  };
  iteration(false);
  iteration(false);  // optimizer state exists now
  std::vector<at::Tensor> params;
  for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
  const std::string state = serialized(*optimizer);
  iteration(true);
  EXPECT_EQ(serialized(*optimizer), state);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(BitEqual(model->parameters()[i], params[i])) << "parameter " << i;
  }
  EXPECT_EQ(skipped_steps(*optimizer), 1);
  iteration(false);  // and training continues
  EXPECT_FALSE(BitEqual(model->parameters()[0], params[0]));
  EXPECT_NE(serialized(*optimizer), state);
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, SkippedStepTest,
    ::testing::Values(
        NamedFactory{"SGD", [](auto p) { return std::make_shared<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9)); }},
        NamedFactory{"Adam", [](auto p) { return std::make_shared<torch::optim::Adam>(p, 1e-3); }},
        NamedFactory{"AdamW", [](auto p) { return std::make_shared<torch::optim::AdamW>(p, 1e-3); }},
        NamedFactory{"RMSprop", [](auto p) { return std::make_shared<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(1e-3).momentum(0.5)); }},
        NamedFactory{"Adagrad", [](auto p) { return std::make_shared<torch::optim::Adagrad>(p, 0.1); }}),
    [](const auto& info) { return info.param.name; });

class ScaleLossTest : public AmpTest {};

// One overflowing iteration of a tiny model: the guard sees an inf gradient.
void overflow_step(torch::nn::Linear& model, OptimizerPtr& optimizer) {
  optimizer->zero_grad();
  {
    scale_loss scaled(model(torch::randn({2, 2})).sum(), optimizer);
    scaled.backward();
    model->bias.grad()[0] = kInf;
  }
  optimizer->step();
}

TEST_F(ScaleLossTest, DefaultSinkPrintsOneLinePerEvent) {
  auto model = torch::nn::Linear(2, 1);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  ::testing::internal::CaptureStderr();
  std::tie(model, optimizer) = handle.initialize(model, optimizer, O1);  // default verbosity 1
  overflow_step(model, optimizer);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, ::testing::HasSubstr("opt_level O1"));
  EXPECT_THAT(log, ::testing::EndsWith(
                       "\namp: Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 32768\n"));
}

TEST_F(ScaleLossTest, OneEventPerSkipAndNoFlood) {
  auto model = torch::nn::Linear(2, 1);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  LogRecorder log;
  Options options = O1;
  options.keep_cpu_memory = false;  // its note comes once a process, at whichever test is first
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  overflow_step(model, optimizer);
  std::vector<LogEvent> events = log.take();
  // A CPU that emulates bfloat16 (AVX2) adds its note at initialize (hardware_test.cpp).
  events.erase(std::remove_if(events.begin(), events.end(),
                              [](const LogEvent& e) { return e.code == "cpu_emulates_dtype"; }),
               events.end());
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, LogEvent::Kind::kProperties);
  EXPECT_EQ(events[1].kind, LogEvent::Kind::kStepSkipped);
  EXPECT_EQ(events[1].loss_id, 0);
  EXPECT_EQ(events[1].scale_before, 65536.0);
  EXPECT_EQ(events[1].scale_after, 32768.0);
  for (int i = 0; i < 30; ++i) overflow_step(model, optimizer);
  events = log.take();
  ASSERT_EQ(events.size(), 5u);  // 4 more skips, one suppression notice, then silence
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(events[i].kind, LogEvent::Kind::kStepSkipped);
    EXPECT_EQ(events[i].scale_after, 65536.0 / (4 << i));
  }
  EXPECT_EQ(events[4].kind, LogEvent::Kind::kSkipsSuppressed);
}

TEST_F(ScaleLossTest, VerbosityZeroIsSilent) {
  auto model = torch::nn::Linear(2, 1);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  LogRecorder log;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
  overflow_step(model, optimizer);
  EXPECT_TRUE(log.take().empty());
}

// --- Exact training equivalence (Apex's tests/L0/run_amp style) -------------

// y = x.mm(w) with small-integer inputs and weights on a 1/8 grid: every
// forward, gradient, scaled gradient and SGD update is exact in bf16 and
// fp32, so amp and a plain fp32 loop must agree bit for bit.
struct GridModelImpl : torch::nn::Module {
  explicit GridModelImpl(int offset)
      : w(register_parameter("w", (torch::arange(4, torch::kFloat).view({4, 1}) + offset) / 8)) {}
  torch::Tensor forward(const torch::Tensor& x) { return x.mm(w); }
  torch::Tensor w;
};
TORCH_MODULE(GridModel);

struct Plan {
  bool overflow_a_in_loss0 = false;  // skips both optimizers (loss 0 covers both)
  bool overflow_b_in_loss1 = false;  // skips only optimizer B
};

const std::vector<Plan>& plans() {
  static const std::vector<Plan> p = {{}, {true, false}, {}, {false, true}, {}};
  return p;
}

at::Tensor grid_input(int step) {
  return (torch::arange(8, torch::kFloat).view({2, 4}) + step) .remainder(5) - 2;  // ints in [-2, 2]
}

// Plain fp32 LibTorch: the same losses; skipped steps simply not taken.
std::pair<at::Tensor, at::Tensor> reference_run() {
  GridModel a(0), b(3);
  torch::optim::SGD opt_a(a->parameters(), 0.125), opt_b(b->parameters(), 0.125);
  for (size_t step = 0; step < plans().size(); ++step) {
    opt_a.zero_grad();
    opt_b.zero_grad();
    const auto x = grid_input(step);
    (a(x).sum() + b(x).sum()).backward();
    (b(x).sum() * 2).backward();
    if (!plans()[step].overflow_a_in_loss0) {
      opt_a.step();
      if (!plans()[step].overflow_b_in_loss1) opt_b.step();
    }
  }
  return {a->w.detach().clone(), b->w.detach().clone()};
}

class EquivalenceTest : public AmpTest,
                        public ::testing::WithParamInterface<std::tuple<OptLevel, double>> {};

TEST_P(EquivalenceTest, TwoModelsTwoOptimizersTwoLossesMatchFp32) {
  const auto [level, scale] = GetParam();
  GridModel a(0), b(3);
  OptimizerPtr opt_a = std::make_shared<torch::optim::SGD>(a->parameters(), 0.125);
  OptimizerPtr opt_b = std::make_shared<torch::optim::SGD>(b->parameters(), 0.125);
  Options options = quiet(level);
  options.num_losses = 2;
  options.loss_scale = LossScale::Dynamic(scale);
  Handle handle;
  handle.initialize({a, b}, {opt_a, opt_b}, options);
  for (size_t step = 0; step < plans().size(); ++step) {
    opt_a->zero_grad();
    opt_b->zero_grad();
    const auto x = grid_input(step);
    // Apex's multiple-loss example: the losses first, then a guard each.
    const auto loss0 = a(x).sum() + b(x).sum(), loss1 = b(x).sum() * 2;
    {
      scale_loss scaled(loss0, {opt_a, opt_b}, {/*loss_id=*/0});
      scaled.backward();
      if (plans()[step].overflow_a_in_loss0) a->w.grad()[0][0] = kInf;
    }
    {
      scale_loss scaled(loss1, opt_b, {/*loss_id=*/1});
      scaled.backward();
      if (plans()[step].overflow_b_in_loss1) b->w.grad()[1][0] = kInf;
    }
    opt_a->step();
    opt_b->step();
  }
  const auto [ref_a, ref_b] = reference_run();
  EXPECT_TRUE(BitEqual(a->w, ref_a.to(a->w.scalar_type())));
  EXPECT_TRUE(BitEqual(b->w, ref_b.to(b->w.scalar_type())));
  if (level == O2) {
    EXPECT_TRUE(BitEqual(master_params(*opt_a)[0], ref_a));  // fp32 masters
    EXPECT_TRUE(BitEqual(master_params(*opt_b)[0], ref_b));
  }
  EXPECT_EQ(loss_scale(0), scale / 2);  // one overflow each
  EXPECT_EQ(loss_scale(1), scale / 2);
}

INSTANTIATE_TEST_SUITE_P(
    Levels, EquivalenceTest,
    ::testing::Combine(::testing::Values(O0, O1, O2, O3), ::testing::Values(4.0, 16.0)),
    [](const auto& info) {
      return std::string(to_string(std::get<0>(info.param))) + "_scale" +
             std::to_string(static_cast<int>(std::get<1>(info.param)));
    });

class AccumulationTest : public AmpTest, public ::testing::WithParamInterface<OptLevel> {};

TEST_P(AccumulationTest, DelayUnscaleEqualsTheUnaccumulatedReference) {
  GridModel model(1), reference(1);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.125);
  Options options = quiet(GetParam());
  options.loss_scale = LossScale::Dynamic(16.0);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  optimizer->zero_grad();
  for (int micro = 0; micro < 4; ++micro) {
    scale_loss scaled(model(grid_input(micro)).sum(), optimizer, {0, /*delay_unscale=*/micro < 3});
    scaled.backward();
  }
  optimizer->step();
  torch::optim::SGD plain(reference->parameters(), 0.125);
  at::Tensor total = torch::zeros({});
  for (int micro = 0; micro < 4; ++micro) total = total + reference(grid_input(micro)).sum();
  total.backward();
  plain.step();
  EXPECT_TRUE(BitEqual(model->w, reference->w.detach().to(model->w.scalar_type())));
}

TEST_P(AccumulationTest, OverflowInAnyMicroBatchSkipsTheAccumulatedStep) {
  GridModel model(1);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.125);
  Options options = quiet(GetParam());
  options.loss_scale = LossScale::Dynamic(16.0);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  const auto before = model->w.detach().clone();
  optimizer->zero_grad();
  for (int micro = 0; micro < 3; ++micro) {
    scale_loss scaled(model(grid_input(micro)).sum(), optimizer, {0, micro < 2});
    scaled.backward();
    if (micro == 0) model->w.grad()[2][0] = kInf;
  }
  optimizer->step();
  EXPECT_TRUE(BitEqual(model->w, before));
  EXPECT_EQ(loss_scale(), 8.0);
}

INSTANTIATE_TEST_SUITE_P(Levels, AccumulationTest, ::testing::Values(O1, O2),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST_F(ScaleLossTest, ClippingAfterExplicitUnscaleEqualsFp32Clipping) {
  GridModel model(2), reference(2);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.125);
  Options options = quiet(O1);
  options.loss_scale = LossScale::Dynamic(1024.0);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  {
    scale_loss scaled(model(grid_input(0)).sum(), optimizer);
    scaled.backward();
    scaled.unscale();
    torch::nn::utils::clip_grad_norm_(master_params(*optimizer), 0.5);
    EXPECT_AMP_ERROR(scaled.unscale(), "already called");
  }
  optimizer->step();
  torch::optim::SGD plain(reference->parameters(), 0.125);
  reference(grid_input(0)).sum().backward();
  torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.5);
  plain.step();
  EXPECT_TRUE(BitEqual(model->w, reference->w.detach()));
}

TEST_F(ScaleLossTest, GradientPenaltyWithTheCurrentScale) {
  GridModel model(2), reference(2);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.125);
  Options options = quiet(O1);
  options.loss_scale = LossScale::Dynamic(256.0);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  const auto x = grid_input(1);
  const auto loss = model(x).to(at::kFloat).pow(2).sum() / 8;
  // GradScaler's recipe: grads of the scaled loss, divided by the scale.
  const at::Tensor scale = internal::live_scaling().scale_tensor(loss.device());
  const auto scaled_grads = torch::autograd::grad({loss * scale}, {model->w}, {}, true, true);
  const auto penalty = (scaled_grads[0] / scale).pow(2).sum() / 64;
  {
    scale_loss scaled(loss + penalty, optimizer);
    scaled.backward();
  }
  const auto ref_loss = reference(x).pow(2).sum() / 8;
  const auto ref_grads = torch::autograd::grad({ref_loss}, {reference->w}, {}, true, true);
  (ref_loss + ref_grads[0].pow(2).sum() / 64).backward();
  EXPECT_TRUE(BitEqual(model->w.grad(), reference->w.grad()));
}

TEST_F(ScaleLossTest, LossesWithDifferentScalesCombine) {
  GridModel model(0), reference(0);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.125);
  Options options = quiet(O1);
  options.num_losses = 2;
  options.loss_scale = LossScale::Dynamic(64.0);
  options.dynamic_scaling.growth_interval = 1;  // loss 1's scale grows, loss 0's is reset below
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  internal::live_scaling(1).scale_tensor(at::kCPU).fill_(4096.0);
  const auto x = grid_input(3);
  {
    scale_loss scaled(model(x).sum(), optimizer, {0});
    scaled.backward();
  }
  {
    scale_loss scaled(model(x).sum() * 3, optimizer, {1});
    scaled.backward();
  }
  (reference(x).sum() + reference(x).sum() * 3).backward();
  EXPECT_TRUE(BitEqual(model->w.grad(), reference->w.grad()));
}

// --- Disabled ----------------------------------------------------------------

// Options::enabled = false: the amp loop is the plain float32 loop, bit for
// bit, at any level - nothing converted or cast, a scale of 1, and an
// overflowed step applied as plain LibTorch applies it.
TEST_F(ScaleLossTest, DisabledAmpRunsTheLoopAsPlainFloat32) {
  for (OptLevel level : {O1, O2, O3}) {
    SCOPED_TRACE(to_string(level));
    torch::manual_seed(3);
    auto model = TinyNet(), reference = TinyNet();
    {
      torch::NoGradGuard no_grad;
      const auto from = model->parameters(), to = reference->parameters();
      for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
    }
    OptimizerPtr optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-2);
    torch::optim::Adam plain(reference->parameters(), 1e-2);
    Options off = quiet(level);
    off.enabled = false;
    Handle handle;
    std::tie(model, optimizer) = handle.initialize(model, optimizer, off);
    EXPECT_FALSE(properties().enabled);
    EXPECT_EQ(model->fc1->weight.scalar_type(), at::kFloat);
    const CastCounts casts_before = cast_counts();
    for (int step = 0; step < 4; ++step) {
      const auto x = torch::randn({4, 8});
      const bool overflow = step == 3;
      optimizer->zero_grad();
      {
        scale_loss scaled(model->forward(x).pow(2).mean(), optimizer);
        EXPECT_EQ(scaled.loss_scale().item<double>(), 1.0);
        scaled.backward();
        if (overflow) model->fc2->bias.grad()[0] = kInf;
      }
      optimizer->step();
      plain.zero_grad();
      reference->forward(x).pow(2).mean().backward();
      if (overflow) reference->fc2->bias.grad()[0] = kInf;
      plain.step();
      EXPECT_FALSE(last_step_skipped(*optimizer)) << "step " << step;
      const auto ours = model->parameters(), theirs = reference->parameters();
      for (size_t i = 0; i < ours.size(); ++i) {
        EXPECT_TRUE(BitEqual(ours[i], theirs[i])) << "step " << step << ", parameter " << i;
      }
    }
    EXPECT_EQ(cast_counts().casts, casts_before.casts);
    EXPECT_FALSE(torch::isfinite(model->fc2->bias).all().item<bool>());  // the overflow was applied
  }
}

TEST_F(ScaleLossTest, DisabledAmpStillValidatesTheOptions) {
  auto model = TinyNet();
  Options off = quiet(O1);
  off.enabled = false;
  off.master_weights = true;  // refused at O1 whether or not amp is enabled
  EXPECT_AMP_ERROR(amp::initialize(model, off), "master_weights make no sense");
  EXPECT_FALSE(is_initialized());
}

// --- Misuse ------------------------------------------------------------------

TEST_F(ScaleLossTest, MisuseIsAClearErrorAndChangesNothing) {
  auto model = TinyNet();
  OptimizerPtr plain = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  const auto loss = model->forward(torch::randn({2, 8})).sum();
  EXPECT_AMP_ERROR(scale_loss(loss, plain), "needs amp to be initialized");
  Handle handle;
  OptimizerPtr optimizer;
  std::tie(model, optimizer) = handle.initialize(model, plain, quiet(O1));
  std::vector<at::Tensor> params_before;
  for (const auto& p : model->parameters()) params_before.push_back(p.detach().clone());
  const internal::LossScaling::State scaler_before = internal::live_scaling().state();
  const auto out = model->forward(torch::randn({2, 8}));
  EXPECT_AMP_ERROR(scale_loss(out, optimizer), "scalar loss");
  EXPECT_AMP_ERROR(scale_loss(torch::ones({}, at::kLong), optimizer), "floating-point loss");
  EXPECT_AMP_ERROR(scale_loss(out.sum(), optimizer, {/*loss_id=*/1}), "num_losses=1");
  auto stranger = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  EXPECT_AMP_ERROR(scale_loss(out.sum(), stranger), "not passed to the live amp::initialize");
  EXPECT_AMP_ERROR(scale_loss(out.sum(), {optimizer, optimizer}), "the same optimizer twice");
  const auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(BitEqual(params[i], params_before[i])) << "parameter " << i;
    EXPECT_FALSE(params[i].grad().defined()) << "parameter " << i;
  }
  EXPECT_TRUE(BitEqual(internal::live_scaling().state().scale, scaler_before.scale));
  EXPECT_TRUE(BitEqual(internal::live_scaling().state().growth_tracker, scaler_before.growth_tracker));
  {
    scale_loss scaled(out.sum(), optimizer);
    EXPECT_AMP_ERROR(scale_loss(out.sum(), optimizer), "inside a live scale_loss guard");
    scaled.backward();
  }
  optimizer->step();  // the guard's state is consistent after all the refusals
}

// Throws from its backward, as a failing custom kernel would.
struct ThrowingBackward : torch::autograd::Function<ThrowingBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    throw std::runtime_error("backward failed");
  }
};

TEST_F(ScaleLossTest, BackwardThrowingInsideTheGuardRestoresGradientsAndTrainingContinues) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
  {  // gradients present before the failing guard must survive it
    scale_loss scaled(model->forward(torch::randn({2, 8})).to(at::kFloat).sum(), optimizer);
    scaled.backward();
  }
  const auto grad_before = model->fc1->weight.grad().clone();
  const double scale_before = loss_scale();
  try {
    const auto h = model->fc1(torch::randn({2, 8}));
    const auto loss = ThrowingBackward::apply(h.to(at::kFloat)).sum() + model->fc2(torch::relu(h)).sum();
    scale_loss scaled(loss, optimizer);
    scaled.backward();
    FAIL() << "backward should have thrown";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("backward failed"));
  }
  EXPECT_TRUE(BitEqual(model->fc1->weight.grad(), grad_before));
  EXPECT_EQ(loss_scale(), scale_before);
  EXPECT_EQ(cast_cache_size(), 0u);
  EXPECT_EQ(torch::mm(torch::randn({2, 2}), torch::randn({2, 2})).scalar_type(), at::kBFloat16);
  optimizer->zero_grad();
  {
    scale_loss scaled(model->forward(torch::randn({2, 8})).to(at::kFloat).sum(), optimizer);
    scaled.backward();
  }
  optimizer->step();
  EXPECT_EQ(skipped_steps(*optimizer), 0);
}

TEST_F(ScaleLossTest, StaticScaleOneWithoutMastersIsAPassThrough) {
  GridModel model(1), reference(1);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.125);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O0));
  const auto loss = model(grid_input(0)).sum();
  {
    scale_loss scaled(loss, optimizer);
    EXPECT_TRUE(scaled.scaled_loss().is_same(loss));  // no multiply at scale 1 in fp32
    scaled.backward();
  }
  reference(grid_input(0)).sum().backward();
  EXPECT_TRUE(BitEqual(model->w.grad(), reference->w.grad()));
}

// A guard that unscales for clipping across several optimizers checks the
// gradients they kept from earlier guards: with amp's fused optimizers an
// overflow's inf/NaN stay there until the device's verdict skips the step,
// and a joint norm would carry them into every gradient, so the guard that
// unscaled for the clip skips all of them. Without unscale() (no clip
// inside) the clean optimizer steps. LibTorch's own optimizers lose an
// overflowed guard's gradients at once: nothing poisoned is kept.
TEST_F(ScaleLossTest, ClipAcrossOptimizersAfterAnOverflowSkipsAllOfThem) {
  for (bool fused : {true, false}) {
    for (bool clip : {true, false}) {
      SCOPED_TRACE(std::string(fused ? "fused" : "LibTorch's Adam") + (clip ? ", clip inside the guard" : ", no clip"));
      TinyNet a, b;
      auto make = [fused](TinyNet& m) -> OptimizerPtr {
        if (fused) return std::make_shared<amp::optim::FusedAdam>(m->parameters(), 1e-2);
        return std::make_shared<torch::optim::Adam>(m->parameters(), 1e-2);
      };
      OptimizerPtr opt_a = make(a), opt_b = make(b);
      Options options = quiet(O1);
      options.num_losses = 2;
      Handle handle;
      handle.initialize({a, b}, {opt_a, opt_b}, options);
      const auto x = torch::randn({4, 8});
      {
        scale_loss scaled(b(x).sum(), opt_b, {/*loss_id=*/0});
        scaled.backward();
        b->fc1->bias.mutable_grad().fill_(std::numeric_limits<float>::infinity());
      }
      EXPECT_EQ(b->fc1->bias.grad().defined(), fused) << "LibTorch's optimizers keep nothing poisoned";
      const auto a_before = a->fc1->weight.clone();
      {
        scale_loss scaled(a(x).sum() + b(x).sum(), {opt_a, opt_b}, {/*loss_id=*/1});
        scaled.backward();
        if (clip) {
          scaled.unscale();
          std::vector<at::Tensor> all = master_params(*opt_a);
          for (const auto& p : master_params(*opt_b)) all.push_back(p);
          torch::nn::utils::clip_grad_norm_(all, 1.0);
        }
      }
      opt_a->step();
      opt_b->step();
      EXPECT_EQ(last_step_skipped(*opt_b), fused);
      EXPECT_EQ(last_step_skipped(*opt_a), fused && clip);
      EXPECT_EQ(torch::equal(a->fc1->weight, a_before), fused && clip);
      EXPECT_EQ(loss_scale(0), 32768.0) << "the overflowing loss backs off";
      EXPECT_EQ(loss_scale(1), 65536.0) << "the clipping loss's own gradients were finite";
    }
  }
}

}  // namespace
}  // namespace amp::testing
