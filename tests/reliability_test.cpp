// SPDX-License-Identifier: BSD-3-Clause
// Reliability: randomized fault injection against a reference that skips
// exactly the faulty steps, exceptions in forward, concurrency, and a table of
// bad inputs that must each be refused without changing anything.
#include "test_util.h"

#include <ATen/autocast_mode.h>

#include <c10/util/ScopeExit.h>

#include <cstdio>
#include <random>
#include <thread>

#include <unistd.h>

namespace amp::testing {
namespace {


enum class Fault { kNone, kInfGrad, kNaNGrad, kNaNLoss, kInfActivation };

std::vector<Fault> fault_plan(int steps, uint32_t seed) {
  std::mt19937 random(seed);
  std::uniform_int_distribution<int> pick(0, 9);  // ~30% of steps faulty
  std::vector<Fault> plan;
  for (int i = 0; i < steps; ++i) {
    const int r = pick(random);
    plan.push_back(r < 7 ? Fault::kNone : static_cast<Fault>(r - 6 + (r == 9 ? random() % 2 : 0)));
  }
  return plan;
}

struct MlpImpl : torch::nn::Module {
  MlpImpl() : a(register_module("a", torch::nn::Linear(6, 12))), b(register_module("b", torch::nn::Linear(12, 3))) {}
  torch::Tensor forward(const torch::Tensor& x, bool poison) {
    auto h = torch::tanh(a(x));
    if (poison) h = h * torch::full({1}, kInf);  // an inf activation
    return b(h);
  }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Mlp);

struct RunResult {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> optimizer_state;
  double scale;
  int64_t growth_tracker;
  int64_t skipped;
};

// Trains `plan.size()` steps. With `inject`, each planned fault happens; the
// reference run (inject=false) instead skips those iterations entirely and
// tells the scaler about the overflow, as the faulty run's guard does.
RunResult train(OptLevel level, bool adam, const std::vector<Fault>& plan, bool inject) {
  torch::manual_seed(7);
  Mlp model;
  OptimizerPtr optimizer = adam ? OptimizerPtr(std::make_shared<torch::optim::Adam>(model->parameters(), 1e-2))
                                : OptimizerPtr(std::make_shared<torch::optim::SGD>(
                                      model->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9)));
  Options options = level;
  options.verbosity = 0;
  options.loss_scale = LossScale::Dynamic(1024.0);
  options.dynamic_scaling.growth_interval = 10;  // exercise growth too
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  int64_t reference_skips = 0;
  for (size_t step = 0; step < plan.size(); ++step) {
    const Fault fault = plan[step];
    if (!inject && fault != Fault::kNone) {
      internal::live_scaling().update(overflowed_verdict());  // the overflow the faulty run saw
      ++reference_skips;
      continue;
    }
    torch::manual_seed(1000 + step);
    const auto x = torch::randn({8, 6}), y = torch::randn({8, 3});
    optimizer->zero_grad();
    auto loss = torch::mse_loss(model->forward(x, fault == Fault::kInfActivation), y);
    if (fault == Fault::kNaNLoss) loss = loss * kNaN;
    {
      scale_loss scaled(loss, optimizer);
      scaled.backward();
      if (fault == Fault::kInfGrad) model->b->weight.grad()[step % 3][step % 12] = kInf;
      if (fault == Fault::kNaNGrad) model->a->bias.grad()[step % 12] = kNaN;
    }
    optimizer->step();
  }
  RunResult r;
  for (const auto& p : model->parameters()) r.params.push_back(p.detach().clone());
  for (const auto& m : master_params(*optimizer)) r.params.push_back(m.detach().clone());
  r.optimizer_state = optimizer_state_tensors(*optimizer);
  r.scale = loss_scale();
  r.growth_tracker = loss_scaler()->growth_tracker();
  r.skipped = skipped_steps(*optimizer) + reference_skips;
  return r;
}

class FaultInjectionTest : public AmpTest,
                           public ::testing::WithParamInterface<std::tuple<OptLevel, bool>> {};

TEST_P(FaultInjectionTest, TwoHundredStepsWithRandomFaultsEqualTheReferenceBitForBit) {
  const auto [level, adam] = GetParam();
  const auto plan = fault_plan(200, /*seed=*/2024);
  const int64_t faults = std::count_if(plan.begin(), plan.end(), [](Fault f) { return f != Fault::kNone; });
  ASSERT_GT(faults, 30);
  for (Fault kind : {Fault::kInfGrad, Fault::kNaNGrad, Fault::kNaNLoss, Fault::kInfActivation}) {
    ASSERT_NE(std::find(plan.begin(), plan.end(), kind), plan.end());
  }
  const RunResult faulty = train(level, adam, plan, /*inject=*/true);
  const RunResult reference = train(level, adam, plan, /*inject=*/false);
  ASSERT_EQ(faulty.params.size(), reference.params.size());
  for (size_t i = 0; i < faulty.params.size(); ++i) {
    EXPECT_TRUE(BitEqual(faulty.params[i], reference.params[i])) << "tensor " << i;
  }
  ASSERT_EQ(faulty.optimizer_state.size(), reference.optimizer_state.size());
  ASSERT_FALSE(faulty.optimizer_state.empty());
  for (size_t i = 0; i < faulty.optimizer_state.size(); ++i) {
    EXPECT_TRUE(BitEqual(faulty.optimizer_state[i], reference.optimizer_state[i])) << "state " << i;
  }
  EXPECT_EQ(faulty.scale, reference.scale);
  EXPECT_EQ(faulty.growth_tracker, reference.growth_tracker);
  EXPECT_EQ(faulty.skipped, faults);
  EXPECT_EQ(reference.skipped, faults);
}

INSTANTIATE_TEST_SUITE_P(Levels, FaultInjectionTest,
                         ::testing::Combine(::testing::Values(O1, O2, O3), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_Adam" : "_SGD");
                         });

using ReliabilityTest = AmpTest;
// Tests that run amp on several threads (ThreadSanitizer runs every *ThreadsTest).
class ReliabilityThreadsTest : public ReliabilityTest {};

TEST_F(ReliabilityTest, ForwardThrowingUnderO1LeavesNoStateBehind) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
  EXPECT_THROW(model->forward(torch::randn({2, 5})), c10::Error);  // wrong width: addmm throws inside amp
  EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_FALSE(c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::AutocastCPU));
  optimizer->zero_grad();
  {
    scale_loss scaled(model->forward(torch::randn({2, 8})).to(at::kFloat).sum(), optimizer);
    scaled.backward();
  }
  optimizer->step();
  EXPECT_EQ(skipped_steps(*optimizer), 0);
  EXPECT_EQ(model->forward(torch::randn({2, 8})).scalar_type(), at::kBFloat16);
}

TEST_F(ReliabilityThreadsTest, ThreadsRunningForwardConcurrentlyGetCorrectDtypesAndValues) {
  auto shared = TinyNet();
  Handle handle;
  handle.initialize(shared, quiet(O1));
  constexpr int kThreads = 4;
  std::vector<TinyNet> models;
  std::vector<at::Tensor> inputs, expected;
  for (int t = 0; t < kThreads; ++t) {
    models.push_back(TinyNet());
    inputs.push_back(torch::randn({3, 8}));
    expected.push_back(models.back()->forward(inputs.back()));  // this thread casts too
  }
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      enable_casts casts;
      for (int i = 0; i < 100; ++i) {
        const auto out = models[t]->forward(inputs[t]);
        if (out.scalar_type() != at::kBFloat16 || !torch::equal(out, expected[t])) wrong.fetch_add(1);
        out.to(at::kFloat).sum().backward();  // backward on worker threads: no casts
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
  for (const auto& m : models) EXPECT_EQ(m->fc1->weight.grad().scalar_type(), at::kFloat);
}

TEST_F(ReliabilityThreadsTest, BackwardOnAutogradAndIntraOpThreadsNeverCasts) {
  torch::set_num_threads(2);
  auto model = TinyNet(64, 256, 64);
  Handle handle;
  handle.initialize(model, quiet(O1));
  const auto x = torch::randn({128, 64}, torch::requires_grad());
  const auto loss = model->forward(x).to(at::kFloat).pow(2).sum();
  OpStatsRecorder recorder;
  std::thread other([&] { loss.backward(); });  // a thread without enable_casts
  other.join();
  model->forward(x).to(at::kFloat).sum().backward();  // the casting thread
  int64_t backward_calls = 0;
  for (const auto& row : recorder.stats()) {
    if (!row.in_backward) continue;
    backward_calls += row.calls;
    EXPECT_EQ(row.casts, 0) << row.op;
  }
  EXPECT_GT(backward_calls, 0);
}

// --- Bad input: each a clear error, state unchanged ----------------------------

struct BadInput {
  std::string name;
  std::function<void()> action;
  std::string message;
};

class BadInputTest : public AmpTest, public ::testing::WithParamInterface<BadInput> {};

// A live O1 initialization with one model and optimizer, for rows that need one.
struct Live {
  TinyNet model;
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Live() { std::tie(model, optimizer) = amp::initialize(model, optimizer, AmpTest_quiet(O1)); }
  static Options AmpTest_quiet(OptLevel level) {
    Options o = level;
    o.verbosity = 0;
    return o;
  }
};

std::string saved_state(int num_losses, OptLevel level) {
  Handle handle;
  Options o = level;
  o.verbosity = 0;
  o.num_losses = num_losses;
  handle.initialize(std::vector<ModulePtr>{}, {}, o);
  torch::serialize::OutputArchive archive;
  save_state(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

Options with(std::function<void(Options&)> edit) {
  Options o = O1;
  o.verbosity = 0;
  edit(o);
  return o;
}

void initialize_with(const Options& options) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  amp::initialize(model, optimizer, options);
}

std::vector<BadInput> bad_inputs() {
  return {
      {"LevelLowercase", [] { Options("o1"); }, "capital letter O"},
      {"LevelZeroO", [] { Options("0O"); }, "capital letter O"},
      {"LevelUnknown", [] { Options("O9"); }, "unexpected optimization level 'O9'"},
      {"ScaleZero", [] { initialize_with(with([](Options& o) { o.loss_scale = LossScale::Static(0); })); }, "finite number > 0"},
      {"ScaleNegative", [] { initialize_with(with([](Options& o) { o.loss_scale = LossScale::Dynamic(-2); })); }, "finite number > 0"},
      {"GrowthOne", [] { initialize_with(with([](Options& o) { o.dynamic_scaling.growth_factor = 1; })); }, "growth_factor must be > 1"},
      {"HysteresisBeyondItsCounter", [] { initialize_with(with([](Options& o) { o.dynamic_scaling.hysteresis = int64_t(1) << 32; })); }, "fit an int32 counter"},
      {"BackoffAboveOne", [] { initialize_with(with([](Options& o) { o.dynamic_scaling.backoff_factor = 2; })); }, "backoff_factor must lie in (0, 1)"},
      {"MinAboveMax", [] { initialize_with(with([](Options& o) { o.dynamic_scaling.min_loss_scale = 1e9; })); }, "must not exceed max_loss_scale"},
      {"NumLossesZero", [] { initialize_with(with([](Options& o) { o.num_losses = 0; })); }, "num_losses must be >= 1"},
      {"IntegerLoss", [] { Live live; scale_loss(torch::ones({}, at::kInt), live.optimizer); }, "floating-point loss"},
      {"VectorLoss", [] { Live live; scale_loss(torch::ones({3}), live.optimizer); }, "scalar loss"},
      {"UnknownOptimizer", [] { Live live; scale_loss(torch::ones({}), std::make_shared<torch::optim::SGD>(live.model->parameters(), 0.1)); }, "not passed to the live amp::initialize"},
      {"MasterParamsOfUnknownOptimizer", [] { Live live; torch::optim::SGD sgd(live.model->parameters(), 0.1); master_params(sgd); }, "not passed to the live amp::initialize"},
      {"ModelOnMixedDevices", [] {
         auto m = std::make_shared<torch::nn::Module>();
         m->register_parameter("cpu", torch::zeros({1}));
         m->register_parameter("meta", torch::zeros({1}, torch::kMeta));
         amp::initialize(m, Live::AmpTest_quiet(O2));
       }, "one device"},
      {"SameOptimizerTwice", [] {
         TinyNet m;
         torch::optim::SGD o(m->parameters(), 0.1);
         amp::initialize({m}, {o, o}, Live::AmpTest_quiet(O2));
       }, "the same optimizer twice"},
      {"StateMissingEntries", [] { Live live; torch::serialize::InputArchive empty; load_state(empty); }, "'opt_level'"},
      {"StateOtherNumLosses", [] { const auto s = saved_state(3, O1); Live live; load_state_bytes(s); }, "num_losses=3"},
      {"StateOtherOptLevel", [] { const auto s = saved_state(1, O2); Live live; load_state_bytes(s); }, "saved at opt_level O2"},
      {"StateExtraEntry", [] {
         Live live;
         torch::serialize::OutputArchive out;
         save_state(out);
         out.write("surprise", torch::ones({1}));
         std::ostringstream bytes;
         out.save_to(bytes);
         load_state_bytes(bytes.str());
       }, "unexpected entry 'surprise'"},
      {"StateMistypedEntry", [] {
         Live live;
         torch::serialize::OutputArchive out;
         out.write("opt_level", torch::ones({1}));  // a float where a level name belongs
         out.write("num_losses", torch::ones({1}, at::kLong));
         std::ostringstream bytes;
         out.save_to(bytes);
         load_state_bytes(bytes.str());
       }, "should hold a level name"},
      {"CheckpointFromAnotherOptLevel", [] {
         // One file per process: parallel test runs must not collide.
         const std::string path = "/tmp/amp_bad_input_checkpoint_" + std::to_string(getpid()) + ".pt";
         {
           TinyNet m;
           OptimizerPtr o = std::make_shared<torch::optim::SGD>(m->parameters(), 0.1);
           Handle h;
           std::tie(m, o) = h.initialize(m, o, Live::AmpTest_quiet(O2));
           save_checkpoint(path, {m.ptr()}, {o});
         }
         Live live;
         const auto remove_file = c10::make_scope_exit([&] { std::remove(path.c_str()); });
         load_checkpoint(path, {live.model.ptr()}, {live.optimizer});
       }, "saved at opt_level O2"},
      {"CheckpointMissingFile", [] { Live live; load_checkpoint("/nonexistent/amp.pt", {live.model.ptr()}, {live.optimizer}); }, "missing, truncated or corrupt"},
  };
}

TEST_P(BadInputTest, RefusedClearlyWithoutChangingState) {
  const BadInput& row = GetParam();
  const auto probe = torch::randn({2, 2});
  EXPECT_AMP_ERROR(row.action(), row.message);
  // Nothing leaked: amp may be live only if the row created it, and then
  // still works; LibTorch's own state is as before once it is gone.
  if (is_initialized()) {
    EXPECT_EQ(torch::mm(probe, probe).scalar_type(), at::kBFloat16);
    deinitialize();
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_EQ(torch::mm(probe, probe).scalar_type(), at::kFloat);
}

INSTANTIATE_TEST_SUITE_P(Rows, BadInputTest, ::testing::ValuesIn(bad_inputs()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace amp::testing
