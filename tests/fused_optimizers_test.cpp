// SPDX-License-Identifier: BSD-3-Clause
// amp's fused optimizers (fused.h): Adam, AdamW and SGD stepped by ATen's
// fused kernels, which skip overflowed steps on the device. Checked against
// LibTorch's own Adam, AdamW and SGD on the same loop: values within the
// documented tolerance, skipped steps bit-identical, no host sync per step,
// state and checkpoints LibTorch's.
#include "test_util.h"

#include <functional>
#include <limits>
#include <set>
#include <sstream>

namespace amp::testing {
namespace {

constexpr int kFusedSteps = 8;

// amp's fused class or LibTorch's own, with the same options.
using MakeOptimizer = std::function<OptimizerPtr(const std::vector<at::Tensor>&, bool fused)>;

struct OptimizerCase {
  const char* name;
  MakeOptimizer make;
};

template <class Fused, class Own, class Options>
MakeOptimizer either(Options options) {
  return [options](const std::vector<at::Tensor>& p, bool fused) -> OptimizerPtr {
    if (fused) return std::make_shared<Fused>(p, options);
    return std::make_shared<Own>(p, options);
  };
}

const std::vector<OptimizerCase>& optimizer_cases() {
  using namespace torch::optim;
  using amp::optim::FusedAdam, amp::optim::FusedAdamW, amp::optim::FusedSGD;
  static const std::vector<OptimizerCase> cases = {
      {"Adam", either<FusedAdam, Adam>(AdamOptions(1e-2))},
      {"AdamWeightDecayAmsgrad", either<FusedAdam, Adam>(AdamOptions(1e-2).weight_decay(0.1).amsgrad(true))},
      {"AdamW", either<FusedAdamW, AdamW>(AdamWOptions(1e-2))},
      {"AdamWAmsgrad", either<FusedAdamW, AdamW>(AdamWOptions(1e-2).weight_decay(0.3).amsgrad(true))},
      {"Sgd", either<FusedSGD, SGD>(SGDOptions(0.1))},
      {"SgdMomentumDampening", either<FusedSGD, SGD>(SGDOptions(0.1).momentum(0.9).dampening(0.25))},
      {"SgdNesterovWeightDecay",
       either<FusedSGD, SGD>(SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01))},
  };
  return cases;
}

// The documented tolerance: the kernels order float32 arithmetic differently
// from LibTorch's step, a few roundings per step. Over these 8 steps the
// largest difference seen is 1.2e-7 (Adam, SGD with momentum); plain SGD and
// AdamW happen to agree bit for bit.
::testing::AssertionResult Close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  return AllClose(a, b, /*rtol=*/1e-6, /*atol=*/1e-7);
}

struct StepRecord {
  std::vector<at::Tensor> stepped;  // master_params after the step
  std::vector<at::Tensor> model;    // the model's parameters after the step
  std::vector<at::Tensor> state;
  bool skipped;
  int64_t host_syncs;
};

struct FusedLoop {
  OptLevel level = O1;
  bool fused = true;
  std::set<int> overflow_at;  // steps whose gradients get an inf
  int steps = kFusedSteps;
};

// A regression loop with a learning rate changed every step (as a scheduler
// would), recording everything after each step.
std::vector<StepRecord> train(const OptimizerCase& opt, const FusedLoop& loop) {
  torch::manual_seed(0);
  TinyNet model;
  OptimizerPtr optimizer = opt.make(model->parameters(), loop.fused);
  Handle handle;
  Options options = loop.level;
  options.verbosity = 0;
  // O4/O5 default to a static scale of 1 (bfloat16), where nothing is
  // skipped; a dynamic scale brings overflow verdicts in.
  options.loss_scale = LossScale::Dynamic();
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  const double lr = optimizer->param_groups()[0].options().get_lr();
  torch::manual_seed(1);
  std::vector<StepRecord> records;
  for (int step = 0; step < loop.steps; ++step) {
    const auto x = torch::randn({16, 8}), y = torch::randn({16, 4});
    optimizer->param_groups()[0].options().set_lr(lr * (1.0 - 0.05 * step));
    const int64_t syncs = host_syncs();
    optimizer->zero_grad();
    {
      scale_loss scaled(torch::mse_loss(model(x).to(at::kFloat), y), optimizer);
      scaled.backward();
      if (loop.overflow_at.count(step)) model->fc2->bias.mutable_grad().fill_(kInf);
    }
    optimizer->step();
    const int64_t step_syncs = host_syncs() - syncs;
    records.push_back({clones(master_params(*optimizer)), clones(model->parameters()),
                       clones(optimizer_state_tensors(*optimizer)), last_step_skipped(*optimizer), step_syncs});
  }
  EXPECT_EQ(skipped_steps(*optimizer), static_cast<int64_t>(loop.overflow_at.size()));
  return records;
}

using FusedStepTest = AmpTest;

class FusedStepEquivalence : public AmpTest,
                             public ::testing::WithParamInterface<std::tuple<int, OptLevel>> {};

// Fused and LibTorch's own step on the same loop, with an overflow at step 2
// (the very first step for state creation at step 0 comes with it too):
// every step within the tolerance, the same steps skipped, and a skipped
// step changes nothing at all.
TEST_P(FusedStepEquivalence, MatchesLibTorchsOwnStepAndSkipsBitIdentically) {
  const auto [index, level] = GetParam();
  const OptimizerCase& opt = optimizer_cases()[index];
  const FusedLoop fused{level, true, {0, 2}}, own{level, false, {0, 2}};
  const auto a = train(opt, fused), b = train(opt, own);
  for (int step = 0; step < kFusedSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    EXPECT_EQ(a[step].skipped, b[step].skipped);
    EXPECT_EQ(a[step].skipped, fused.overflow_at.count(step) == 1);
    EXPECT_TRUE(Close(a[step].stepped, b[step].stepped));
    EXPECT_TRUE(Close(a[step].model, b[step].model));
    EXPECT_TRUE(Close(a[step].state, b[step].state));
    if (a[step].skipped && step > 0) {
      EXPECT_TRUE(AllBitEqual(a[step].stepped, a[step - 1].stepped));
      EXPECT_TRUE(AllBitEqual(a[step].model, a[step - 1].model));
      EXPECT_TRUE(AllBitEqual(a[step].state, a[step - 1].state));
    }
    EXPECT_EQ(a[step].host_syncs, 0) << "the fused step reads nothing on the host";
    EXPECT_EQ(b[step].host_syncs, 1) << "LibTorch's own step: one read decides it";
  }
  EXPECT_TRUE(a[0].state.empty()) << "a skipped first step creates no state, as in LibTorch";
}

std::string equivalence_name(const ::testing::TestParamInfo<std::tuple<int, OptLevel>>& info) {
  return std::string(optimizer_cases()[std::get<0>(info.param)].name) + "_" +
         to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(AdamAdamWSgd, FusedStepEquivalence,
                         ::testing::Combine(::testing::Range(0, 7), ::testing::Values(O1, O2, O4, O5)),
                         equivalence_name);

// Other optimizers read the verdict once a step.
TEST_F(FusedStepTest, OtherOptimizersReadOnceAStep) {
  const OptimizerCase rmsprop{"RMSprop", [](const auto& p, bool) -> OptimizerPtr {
                                return std::make_shared<torch::optim::RMSprop>(p, 1e-2);
                              }};
  for (const auto& record : train(rmsprop, {O1, true, {3}})) EXPECT_EQ(record.host_syncs, 1);
}

// Low-precision parameters (O3): the Adam kernels step bfloat16 or float16
// weights with state in their dtype, as LibTorch's step creates it,
// computing in float32 and rounding once where LibTorch rounds after every
// op - so no host read, a skipped step changes nothing, and the values stay
// within a few low-precision roundings of LibTorch's own (eps 1e-4: 1e-8 is
// 0 in float16). SGD on the CPU is LibTorch's step with one read: ATen's
// CPU _fused_sgd_ does not update such parameters (checked below).
TEST_F(FusedStepTest, LowPrecisionParametersStepOnTheDeviceToo) {
  using namespace torch::optim;
  const OptimizerCase adamw{"AdamW", either<amp::optim::FusedAdamW, AdamW>(AdamWOptions(1e-2).eps(1e-4))};
  const auto a = train(adamw, {O3, true, {2}}), b = train(adamw, {O3, false, {2}});
  for (int step = 0; step < kFusedSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ASSERT_EQ(a[step].model.front().scalar_type(), at::kBFloat16);  // O3 on the CPU
    EXPECT_EQ(a[step].host_syncs, 0);
    EXPECT_EQ(a[step].skipped, step == 2);
    EXPECT_EQ(b[step].skipped, step == 2);
    // bfloat16's 8 bits: a rounding is up to 2^-8 of the value.
    EXPECT_TRUE(AllClose(a[step].model, b[step].model, /*rtol=*/8e-3, /*atol=*/1e-3));
    if (step == 2) {
      EXPECT_TRUE(AllBitEqual(a[step].model, a[step - 1].model));
      EXPECT_TRUE(AllBitEqual(a[step].state, a[step - 1].state));
    }
  }
  const OptimizerCase sgd{"SgdMomentum", either<amp::optim::FusedSGD, SGD>(SGDOptions(0.1).momentum(0.9))};
  const auto c = train(sgd, {O3, true, {2}}), d = train(sgd, {O3, false, {2}});
  for (int step = 0; step < kFusedSteps; ++step) {
    EXPECT_EQ(c[step].host_syncs, 1);
    EXPECT_TRUE(AllBitEqual(c[step].model, d[step].model)) << "step " << step;
  }
  // Why: ATen's CPU kernel leaves a bfloat16 parameter of 64 elements as it was.
  const at::Tensor p = torch::randn({64}).to(at::kBFloat16), g = torch::ones({64}, at::kBFloat16);
  at::Tensor stepped = p.clone();
  at::_fused_sgd_({stepped}, {g}, {}, 0.0, 0.0, 0.1, 0.0, false, false, false);
  EXPECT_TRUE(BitEqual(stepped, p)) << "ATen's CPU _fused_sgd_ now steps bfloat16: amp can use it at O3 on the CPU";
}

// ATen's fused AdamW on low-precision parameters (O3) computes in float32 and
// rounds each result once into the parameter's dtype. Checked step by step
// against that arithmetic in float64 from the step's own inputs (parameters,
// unscaled gradients, stored moments): every parameter and moment within one
// rounding. LibTorch's own step is no reference in float16: it computes in
// float16, where (1 - beta2) * g^2 flushes to zero for |g| below 7.7e-3,
// so the two differ by far more than a rounding (0.66 after 4 steps).
void ExpectAdamWIsFloat32RoundedOnce(c10::Device device, at::ScalarType dtype) {
  SCOPED_TRACE(std::string(c10::DeviceTypeName(device.type())) + " " + c10::toString(dtype));
  torch::manual_seed(0);
  TinyNet model;
  model->to(device);
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  OptimizerPtr optimizer = std::make_shared<amp::optim::FusedAdamW>(model->parameters(), adamw);
  Options options = O3;
  options.verbosity = 0;
  options.cpu_dtype = dtype;
  options.cuda_dtype = dtype;
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  const double lr = adamw.lr(), wd = adamw.weight_decay(), eps = adamw.eps();
  const auto [beta1, beta2] = adamw.betas();
  // Rounding to nearest is within half a unit in the last place, and float32
  // intermediates can tip a tie: one unit, 2^-10 (float16) or 2^-7
  // (bfloat16) of the value, or the smallest subnormal near zero. Where terms
  // cancel, float32's own roundings (a few units of 2^-24 of the terms) are
  // larger than the result: they are allowed too.
  const double rtol = dtype == at::kHalf ? 0x1p-10 : 0x1p-7;
  const double atol = dtype == at::kHalf ? 0x1p-24 : 0x1p-133;
  torch::manual_seed(1);
  for (int step = 1; step <= 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    optimizer->zero_grad();
    {
      scale_loss scaled(model(torch::randn({16, 8}, device)).to(at::kFloat).pow(2).mean(), optimizer);
      scaled.backward();
    }
    struct Inputs {
      at::Tensor param, grad, exp_avg, exp_avg_sq;
    };
    std::vector<Inputs> before;
    for (const auto& p : model->parameters()) {
      ASSERT_EQ(p.scalar_type(), dtype);
      auto it = optimizer->state().find(p.unsafeGetTensorImpl());
      const auto* s = it == optimizer->state().end()
                          ? nullptr
                          : static_cast<const torch::optim::AdamWParamState*>(it->second.get());
      const auto to64 = [](const at::Tensor& t) { return t.detach().to(at::kCPU, at::kDouble); };
      before.push_back({to64(p), to64(p.grad()), s ? to64(s->exp_avg()) : torch::zeros_like(to64(p)),
                        s ? to64(s->exp_avg_sq()) : torch::zeros_like(to64(p))});
    }
    optimizer->step();
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const Inputs& in = before[i];
      const at::Tensor m = beta1 * in.exp_avg + (1 - beta1) * in.grad;
      const at::Tensor v = beta2 * in.exp_avg_sq + (1 - beta2) * in.grad * in.grad;
      const double bias1 = 1 - std::pow(beta1, step), bias2 = 1 - std::pow(beta2, step);
      const at::Tensor decayed = in.param * (1 - lr * wd);
      const at::Tensor update = (lr / bias1) * m / (v.sqrt() / std::sqrt(bias2) + eps);
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(
          *optimizer->state().at(params[i].unsafeGetTensorImpl()));
      // `terms`: the magnitudes the result was summed from.
      const auto within_a_rounding = [&](const at::Tensor& stored, const at::Tensor& exact,
                                         const at::Tensor& terms, const char* what) {
        const at::Tensor error = (stored.to(at::kCPU, at::kDouble) - exact).abs();
        const at::Tensor allowed = exact.abs() * rtol + terms * 0x1p-20 + atol;
        EXPECT_TRUE(error.le(allowed).all().item<bool>())
            << what << " of parameter " << i << ": largest excess " << (error - allowed).max().item<double>();
      };
      within_a_rounding(params[i], decayed - update, decayed.abs() + update.abs(), "value");
      within_a_rounding(s.exp_avg(), m, (beta1 * in.exp_avg).abs() + ((1 - beta1) * in.grad).abs(), "exp_avg");
      within_a_rounding(s.exp_avg_sq(), v, v, "exp_avg_sq");
    }
  }
}

TEST_F(FusedStepTest, LowPrecisionAdamWIsFloat32ArithmeticRoundedOnce) {
  ExpectAdamWIsFloat32RoundedOnce(torch::kCPU, at::kBFloat16);
  ExpectAdamWIsFloat32RoundedOnce(torch::kCPU, at::kHalf);
}

TEST_F(FusedStepTest, OnCudaLowPrecisionAdamWIsFloat32ArithmeticRoundedOnce) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  ExpectAdamWIsFloat32RoundedOnce(torch::kCUDA, at::kHalf);
  ExpectAdamWIsFloat32RoundedOnce(torch::kCUDA, at::kBFloat16);
}

// A step skipped on the device: everything as before it, the gradients
// discarded as after any skipped step, the counters right.
TEST_F(FusedStepTest, SkippedStepDiscardsGradientsAndCounts) {
  TinyNet model;
  OptimizerPtr optimizer = std::make_shared<amp::optim::FusedAdam>(model->parameters(), 1e-2);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
  const int64_t syncs = host_syncs();
  for (int step = 0; step < 3; ++step) {
    {
      scale_loss scaled(model(torch::randn({4, 8})).sum(), optimizer);
      scaled.backward();
      if (step == 1) model->fc1->weight.mutable_grad().fill_(kInf);
    }
    const auto before = clones(model->parameters());
    const auto state_before = clones(optimizer_state_tensors(*optimizer));
    optimizer->step();
    EXPECT_EQ(last_step_skipped(*optimizer), step == 1);
    if (step == 1) {
      EXPECT_TRUE(AllBitEqual(model->parameters(), before));
      EXPECT_TRUE(AllBitEqual(optimizer_state_tensors(*optimizer), state_before));
      for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
    } else {
      EXPECT_TRUE(model->fc1->weight.grad().defined()) << "taken steps keep gradients (LibTorch)";
      optimizer->zero_grad();
    }
  }
  EXPECT_EQ(skipped_steps(*optimizer), 1);
  EXPECT_EQ(host_syncs(), syncs);
  const auto& adam = static_cast<const torch::optim::AdamParamState&>(
      *optimizer->state().at(model->fc1->weight.unsafeGetTensorImpl()));
  EXPECT_EQ(adam.step(), 2) << "two steps taken";
}

// Checkpoints are LibTorch's: a fused run's optimizer loads into LibTorch's
// own step and into a plain torch::optim::Adam, and the reverse, and
// training continues alike.
TEST_F(FusedStepTest, CheckpointsLoadIntoEitherPathAndPlainLibTorch) {
  auto run = [&](bool fused, const std::string* load_from, std::string* save_to) {
    torch::manual_seed(0);
    TinyNet model;
    OptimizerPtr optimizer = optimizer_cases()[0].make(model->parameters(), fused);
    Handle handle;
    std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
    if (load_from) {
      std::istringstream in(*load_from);
      torch::serialize::InputArchive archive;
      archive.load_from(in);
      optimizer->load(archive);
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.fill_(0.5);  // the same starting point for both
    }
    torch::manual_seed(1);
    for (int step = 0; step < 4; ++step) {
      optimizer->zero_grad();
      {
        scale_loss scaled(torch::mse_loss(model(torch::randn({16, 8})), torch::randn({16, 4})), optimizer);
        scaled.backward();
      }
      optimizer->step();
    }
    if (save_to) {
      torch::serialize::OutputArchive archive;
      optimizer->save(archive);
      std::ostringstream out;
      archive.save_to(out);
      *save_to = out.str();
    }
    return std::make_pair(clones(model->parameters()), clones(optimizer_state_tensors(*optimizer)));
  };
  std::string fused_bytes, own_bytes;
  const auto fused_first = run(true, nullptr, &fused_bytes);
  const auto own_first = run(false, nullptr, &own_bytes);
  EXPECT_TRUE(Close(fused_first.second, own_first.second));

  // Saved step counts are the steps taken.
  TinyNet plain_model;
  torch::optim::Adam plain(plain_model->parameters(), 1e-2);
  std::istringstream in(fused_bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  plain.load(archive);
  EXPECT_TRUE(AllBitEqual(optimizer_state_tensors(plain), fused_first.second));
  EXPECT_EQ(static_cast<const torch::optim::AdamParamState&>(
                *plain.state().at(plain_model->fc1->weight.unsafeGetTensorImpl())).step(), 4);

  // Loaded either way round, training continues alike.
  const auto fused_from_own = run(true, &own_bytes, nullptr);
  const auto own_from_fused = run(false, &fused_bytes, nullptr);
  const auto own_from_own = run(false, &own_bytes, nullptr);
  EXPECT_TRUE(Close(fused_from_own.first, own_from_own.first));
  EXPECT_TRUE(Close(own_from_fused.first, own_from_own.first));
  EXPECT_TRUE(Close(fused_from_own.second, own_from_own.second));
}

// Several losses with their own scalers, and accumulation with
// delay_unscale: one device flag over every verdict, no host sync, and an
// overflow in any guard skips the step. LibTorch's own AdamW reads each
// guard's verdict on the host; an overflow in the first loss discards what
// it accumulated, and the step takes the second loss's gradients.
TEST_F(FusedStepTest, SeveralLossesAndAccumulationDecideOnTheDevice) {
  auto run = [&](bool fused, int overflow_loss, bool accumulate) {
    torch::manual_seed(0);
    TinyNet model;
    OptimizerPtr optimizer = optimizer_cases()[2].make(model->parameters(), fused);
    Handle handle;
    Options options = quiet(O2);
    options.num_losses = 2;
    std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
    torch::manual_seed(1);
    const int64_t syncs = host_syncs();
    for (int step = 0; step < 4; ++step) {
      optimizer->zero_grad();
      for (int loss_id = 0; loss_id < 2; ++loss_id) {
        // delay_unscale accumulates from zeroed gradients: loss 0 first.
        const int micro_batches = accumulate && loss_id == 0 ? 3 : 1;
        for (int m = 0; m < micro_batches; ++m) {
          ScaleLossOptions guard{loss_id};
          guard.delay_unscale = m + 1 < micro_batches;
          scale_loss scaled(model(torch::randn({8, 8})).to(at::kFloat).pow(2).mean(), optimizer, guard);
          scaled.backward();
          if (step == 2 && loss_id == overflow_loss && m == 1 % micro_batches) {
            model->fc2->weight.mutable_grad().fill_(kInf);
          }
        }
      }
      optimizer->step();
      const bool skips = step == 2 && (overflow_loss == 1 || (overflow_loss == 0 && fused));
      EXPECT_EQ(last_step_skipped(*optimizer), skips) << "step " << step;
    }
    return std::make_tuple(clones(master_params(*optimizer)), host_syncs() - syncs, loss_scale(0),
                           loss_scale(1));
  };
  for (bool accumulate : {false, true}) {
    for (int overflow_loss : {-1, 0, 1}) {
      SCOPED_TRACE("accumulate " + std::to_string(accumulate) + ", overflow in loss " +
                   std::to_string(overflow_loss));
      const auto [fused_params, fused_syncs, fused_scale0, fused_scale1] = run(true, overflow_loss, accumulate);
      const auto [own_params, own_syncs, own_scale0, own_scale1] = run(false, overflow_loss, accumulate);
      EXPECT_EQ(Close(fused_params, own_params), overflow_loss != 0);
      EXPECT_EQ(fused_syncs, 0);
      EXPECT_EQ(own_syncs, 8) << "one read per guard that unscales";
      EXPECT_EQ(fused_scale0, own_scale0);
      EXPECT_EQ(fused_scale1, own_scale1);
      EXPECT_EQ(fused_scale0 < fused_scale1, overflow_loss == 0);
      EXPECT_EQ(fused_scale1 < fused_scale0, overflow_loss == 1);
    }
  }
}

// One guard over a fused and an unfused optimizer: the unfused one reads the
// shared verdict on the host, the fused one decides on the device; both skip.
TEST_F(FusedStepTest, OneGuardOverFusedAndUnfusedOptimizers) {
  TinyNet a, b;
  OptimizerPtr adam = std::make_shared<amp::optim::FusedAdam>(a->parameters(), 1e-2);
  OptimizerPtr rmsprop = std::make_shared<torch::optim::RMSprop>(b->parameters(), 1e-2);
  const std::vector<OptimizerPtr> optimizers{adam, rmsprop};
  Handle handle;
  handle.initialize({a, b}, {adam, rmsprop}, quiet(O1));
  for (int step = 0; step < 3; ++step) {
    const auto a_before = clones(a->parameters()), b_before = clones(b->parameters());
    {
      const auto x = torch::randn({4, 8});
      scale_loss scaled(a(x).sum() + b(x).sum(), optimizers);
      scaled.backward();
      if (step == 1) b->fc1->bias.mutable_grad().fill_(kInf);
    }
    for (const auto& optimizer : optimizers) optimizer->step();
    for (const auto& optimizer : optimizers) EXPECT_EQ(last_step_skipped(*optimizer), step == 1);
    EXPECT_EQ(AllBitEqual(a->parameters(), a_before), step == 1) << "step " << step;
    EXPECT_EQ(AllBitEqual(b->parameters(), b_before), step == 1) << "step " << step;
    for (const auto& optimizer : optimizers) optimizer->zero_grad();
  }
}

}  // namespace
}  // namespace amp::testing
