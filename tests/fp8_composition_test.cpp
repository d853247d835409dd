// SPDX-License-Identifier: BSD-3-Clause
// The fp8 property beside the rest of amp: overflows that reach a float8
// GEMM are skipped and named, several losses roll each operand's history
// once per use, the weight is quantized once an iteration, the precision
// report counts float8 calls per op and telemetry tallies every float8
// operand, and a step captured in a CUDA graph replays as the eager steps.
#include "test_util.h"

#include "fp8/fp8_linear.h"
#include "session/context.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace amp::testing {
namespace {


struct Mlp2Impl : torch::nn::Module {
  Mlp2Impl()
      : fc1(register_module("fc1", torch::nn::Linear(32, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp2);

detail::Fp8Gemms& gemms() { return *detail::live_context()->fp8(); }

class Fp8CompositionTest : public AmpTest {};

// ---- Non-finite values ------------------------------------------------------

TEST(Fp8NonFiniteTest, AnInfOperandMakesTheProductNonFiniteInsteadOfSaturating) {
  for (const float bad : {kInf, -kInf, std::numeric_limits<float>::quiet_NaN()}) {
    auto site = std::make_shared<detail::Fp8Site>(Options::Fp8Scaling{}, at::kFloat8_e4m3fn, at::kFloat8_e5m2);
    at::Tensor x = torch::randn({4, 16});
    x[1][3] = bad;
    const at::Tensor w = torch::randn({8, 16}, torch::requires_grad());
    const at::Tensor out = detail::fp8_linear(x, w, std::nullopt, site);
    EXPECT_EQ(out.isfinite().sum().item<int64_t>(), 0) << bad;  // saturating would have made it finite
    EXPECT_EQ(site->input.amax_history()[0].item<float>(), 0.0f) << "a non-finite amax stays out of the history";
    // A non-finite incoming gradient does the same to both gradients.
    const at::Tensor clean = detail::fp8_linear(torch::randn({4, 16}), w, std::nullopt, site);
    at::Tensor grad = torch::ones({4, 8});
    grad[0][0] = bad;
    const auto grads = torch::autograd::grad({clean}, {w}, {grad});
    EXPECT_EQ(grads[0].isfinite().sum().item<int64_t>(), 0) << bad;
  }
}

// Loss scaling at O5+fp8: an overflow that enters a float8 GEMM skips the
// step on every path, and provenance names the GEMM - forward (a weight
// holding an inf) and backward (amp's float8 node).
TEST_F(Fp8CompositionTest, AnOverflowThroughAFloat8GemmIsSkippedAndNamed) {
  Options options = fp8_options();
  options.overflow_provenance = true;
  options.loss_scale = LossScale::Dynamic(1024);
  torch::manual_seed(0);
  Mlp2 model;
  amp::optim::FusedAdam optimizer(model->parameters());
  initialize(model, optimizer, options);
  const at::Tensor x = torch::randn({8, 32});
  auto step = [&](double loss_factor) {
    optimizer.zero_grad();
    {
      scale_loss scaled(model->forward(x).to(at::kFloat).pow(2).mean() * loss_factor, optimizer);
      scaled.backward();
    }
    optimizer.step();
  };
  step(1);
  ASSERT_FALSE(last_step_skipped(optimizer));
  const auto masters = clones(master_params(optimizer));

  step(1e38);  // the scaled gradient overflows; saturating it in e5m2 would have hidden that
  EXPECT_TRUE(last_step_skipped(optimizer));
  EXPECT_EQ(loss_scaler()->scale(), 512.0);
  std::optional<OverflowReport> report = last_overflow(optimizer);
  ASSERT_TRUE(report.has_value());
  ASSERT_TRUE(report->backward.has_value());
  const auto& bad = report->non_finite_gradients;  // fc1's only through fc2's float8 backward
  EXPECT_NE(std::find(bad.begin(), bad.end(), "fc1.weight"), bad.end());
  for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(BitEqual(master_params(optimizer)[i], masters[i]));

  {
    torch::NoGradGuard no_grad;
    model->fc2->weight[0][0] = kInf;  // the bfloat16 model weight, as a corrupted load would leave it
  }
  step(1);
  EXPECT_TRUE(last_step_skipped(optimizer));
  report = last_overflow(optimizer);
  ASSERT_TRUE(report.has_value() && report->forward.has_value());
  EXPECT_EQ(report->forward->op, "aten::addmm");  // nn::Linear's 2-D path
  EXPECT_EQ(report->forward->module, "fc2");
  EXPECT_TRUE(report->forward->input_non_finite);
}

// A gradient penalty differentiates backward: refused with the fix, not
// computed wrong (float8 operands carry no graph).
TEST_F(Fp8CompositionTest, ASecondDerivativeThroughFloat8IsRefused) {
  Mlp2 model;
  amp::optim::FusedAdam optimizer(model->parameters());
  initialize(model, optimizer, fp8_options());
  const at::Tensor loss = model->forward(torch::randn({8, 32})).to(at::kFloat).pow(2).mean();
  EXPECT_AMP_ERROR(torch::autograd::grad({loss}, {model->fc1->weight}, {}, /*retain_graph=*/true, /*create_graph=*/true),
                   "cannot be differentiated again");
  const auto first_order = torch::autograd::grad({loss}, {model->fc1->weight});  // the plain backward still runs
  EXPECT_TRUE(first_order[0].isfinite().all().item<bool>());
}

// ---- Several losses, accumulation, the weight's quantization ----------------

// Two models, two losses, two optimizers, a guard each (a GAN's shape):
// every operand's history takes one entry per iteration - the first commit
// after the operand ran - not one per guard.
TEST_F(Fp8CompositionTest, SeveralLossesRollEachOperandsHistoryOncePerUse) {
  Options options = fp8_options();
  options.num_losses = 2;
  torch::manual_seed(1);
  Mlp2 first, second;
  amp::optim::FusedAdam opt_first(first->parameters()), opt_second(second->parameters());
  initialize({first, second}, {opt_first, opt_second}, options);
  constexpr int kIterations = 3;
  for (int it = 0; it < kIterations; ++it) {
    const at::Tensor x = torch::randn({8, 32});
    opt_first.zero_grad();
    {
      scale_loss scaled(first->forward(x).to(at::kFloat).pow(2).mean(), opt_first, {.loss_id = 0});
      scaled.backward();
    }
    opt_first.step();
    opt_second.zero_grad();
    {
      scale_loss scaled(second->forward(x).to(at::kFloat).pow(2).mean(), opt_second, {.loss_id = 1});
      scaled.backward();
    }
    opt_second.step();
  }
  for (Mlp2* model : {&first, &second}) {
    for (const at::Tensor& weight : {(*model)->fc1->weight, (*model)->fc2->weight}) {
      const auto site = gemms().site_of(weight);
      ASSERT_NE(site, nullptr);
      for (const detail::Fp8Scaler* s : {&site->input, &site->weight, &site->grad_output}) {
        const at::Tensor history = s->amax_history();  // latest last once rolled
        const int64_t n = history.size(0);
        EXPECT_EQ(history.narrow(0, n - kIterations, kIterations).gt(0).sum().item<int64_t>(), kIterations);
        EXPECT_EQ(history.narrow(0, 0, n - kIterations).count_nonzero().item<int64_t>(), 0);
      }
    }
  }
}

// Micro-batches read one quantization of each weight; the step that
// changes the weight makes the next one. A second read is the same bits.
TEST_F(Fp8CompositionTest, TheWeightIsQuantizedOnceAnIteration) {
  torch::manual_seed(2);
  Mlp2 model;
  amp::optim::FusedAdam optimizer(model->parameters());
  initialize(model, optimizer, fp8_options());
  const at::Tensor x = torch::randn({3, 8, 32});
  for (int it = 1; it <= 2; ++it) {
    optimizer.zero_grad();
    at::Tensor first_output;
    for (int micro = 0; micro < 3; ++micro) {
      const at::Tensor out = model->forward(x[micro]);
      if (micro == 0) {
        first_output = out.detach().clone();
        EXPECT_TRUE(BitEqual(model->forward(x[0]).detach(), first_output)) << "a second read of the same weight";
      }
      scale_loss scaled(out.to(at::kFloat).pow(2).mean(), optimizer, {0, /*delay_unscale=*/micro < 2});
      scaled.backward();
    }
    optimizer.step();
    EXPECT_EQ(gemms().site_of(model->fc1->weight)->weight_quantizations(), it);
    EXPECT_EQ(gemms().site_of(model->fc2->weight)->weight_quantizations(), it);
  }
}

// ---- What amp reports ----------------------------------------------------------

TEST_F(Fp8CompositionTest, ThePrecisionReportCountsFloat8CallsPerOp) {
  torch::manual_seed(3);
  Mlp2 model;
  amp::optim::FusedAdam optimizer(model->parameters());
  initialize(model, optimizer, fp8_options());
  OpStatsRecorder recorder;
  model->forward(torch::randn({8, 32}));
  model->forward(torch::randn({2, 4, 32}));  // 3-D: rows of every leading dimension
  for (const OpStats& row : recorder.stats()) {
    // nn::Linear: addmm for 2-D inputs, matmul for others.
    if (row.op == "aten::addmm" || row.op == "aten::matmul") EXPECT_EQ(row.float8, row.calls) << row.input_dtypes;
  }
  const auto [float8, fallbacks] = float8_calls(recorder);
  EXPECT_EQ(float8, 4);  // two layers, two forwards; the CPU takes any shape
  EXPECT_EQ(fallbacks, 0);
  const std::string table = format_op_stats(recorder.stats());
  EXPECT_NE(table.find("| float8 | float8 fallbacks |"), std::string::npos) << table;
  EXPECT_NE(table.find("| aten::addmm | cpu | lower_precision | BFloat16, BFloat16, BFloat16 | BFloat16 | 1 | "
                       "0 | 0 | 0 | 1 | 0 |"),
            std::string::npos)
      << table;
  deinitialize();
  // Without fp8 the table keeps its columns.
  initialize(model, optimizer, quiet(O5));
  recorder.reset();
  model->forward(torch::randn({8, 32}));
  EXPECT_EQ(format_op_stats(recorder.stats()).find("float8"), std::string::npos);
}

// One linear layer, two iterations with delayed scaling: the second's
// input holds values above the first's amax (saturated by the delayed
// scale) and values too small for e4m3 at it (flushed), counted exactly.
TEST_F(Fp8CompositionTest, TelemetryTalliesEveryFloat8Operand) {
  torch::manual_seed(4);
  torch::nn::Sequential model(torch::nn::Linear(16, 16));
  torch::optim::SGD optimizer(model->parameters(), /*lr=*/0.0);  // the weight stays: its scale fits it
  Options options = fp8_options();
  initialize(model, optimizer, options);
  EXPECT_AMP_ERROR(fp8_telemetry(), "needs precision telemetry");
  deinitialize();
  options.precision_telemetry = true;
  initialize(model, optimizer, options);
  EXPECT_TRUE(fp8_telemetry().empty());
  auto iterate = [&](const at::Tensor& x) {
    optimizer.zero_grad();
    {
      scale_loss scaled(model->forward(x).to(at::kFloat).sum(), optimizer);
      scaled.backward();
    }
    optimizer.step();
  };
  at::Tensor x1 = torch::rand({4, 16}) * 0.8 + 0.1;  // in [0.1, 0.9]
  x1[3][15] = 1.0f;                                  // amax 1: the next scale is 448
  iterate(x1);
  at::Tensor x2 = x1.clone();
  x2[0][0] = 2.0f, x2[0][1] = -3.0f, x2[1][0] = 1.5f;  // above 448 once scaled: saturated
  x2[2][0] = 1e-6f, x2[2][1] = -1e-6f, x2[2][2] = 0;   // below e4m3's smallest step at 448: flushed (0 is not)
  iterate(x2);
  const std::vector<Fp8TensorTelemetry> t = fp8_telemetry();
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].operand, "grad_output");
  EXPECT_EQ(t[1].operand, "input");
  EXPECT_EQ(t[2].operand, "weight");
  for (const auto& e : t) EXPECT_EQ(e.layer, "0.weight");
  const Fp8TensorTelemetry& input = t[1];
  EXPECT_EQ(input.format, at::kFloat8_e4m3fn);
  EXPECT_EQ(input.calls, 1);
  EXPECT_EQ(input.numel, 64);
  EXPECT_EQ(input.amax, 3.0);
  EXPECT_EQ(input.scale, kE4m3Max);  // 448 / amax 1 of the first iteration
  EXPECT_EQ(input.saturated, 3);
  EXPECT_EQ(input.flushed, 2);
  EXPECT_DOUBLE_EQ(input.saturated_fraction(), 3.0 / 64);
  const Fp8TensorTelemetry& grad = t[0];  // d(sum)/d(out): ones, in e5m2
  EXPECT_EQ(grad.format, at::kFloat8_e5m2);
  EXPECT_EQ(grad.amax, 1.0);
  EXPECT_EQ(grad.saturated + grad.flushed, 0);
  const Fp8TensorTelemetry& weight = t[2];
  EXPECT_EQ(weight.calls, 1);
  EXPECT_EQ(weight.numel, 256);
  EXPECT_EQ(weight.saturated, 0);
  // The master (what the module holds between iterations), as forward read it.
  EXPECT_EQ(weight.amax, model->parameters()[0].to(at::kBFloat16).abs().max().item<double>());
  deinitialize();
  options = quiet(O5);
  options.precision_telemetry = true;
  initialize(model, optimizer, options);
  EXPECT_AMP_ERROR(fp8_telemetry(), "needs the fp8 property");
}

// Float8 only where it pays: a GEMM below min_gemm_intensity runs in
// bfloat16 - exactly as O5 without fp8 - while a larger one beside it runs
// in float8; fp8_choices() and the op counts say which and why.
TEST_F(Fp8CompositionTest, OnlyGemmsWithEnoughIntensityRunInFloat8) {
  torch::manual_seed(6);
  // At 64 rows: 16 -> 64 has 64*16*64 / (64*16 + 16*64 + 64*64) = 10.7
  // multiply-adds per element quantized, 64 -> 256 has 28.4.
  torch::nn::Sequential model(torch::nn::Linear(16, 64), torch::nn::Linear(64, 256));
  torch::optim::SGD optimizer(model->parameters(), /*lr=*/0.1);
  Options options = fp8_options();
  options.fp8_scaling.min_gemm_intensity = 20;
  initialize(model, optimizer, options);
  const at::Tensor x = torch::randn({64, 16});
  OpStatsRecorder recorder;
  const at::Tensor out = model->forward(x);
  std::vector<Fp8LayerChoice> choices = fp8_choices();
  ASSERT_EQ(choices.size(), 2u);
  EXPECT_EQ(choices[0].layer, "0.weight");
  EXPECT_FALSE(choices[0].float8);
  EXPECT_EQ(choices[0].rows, 64);
  EXPECT_EQ(choices[0].in, 16);
  EXPECT_EQ(choices[0].out, 64);
  EXPECT_DOUBLE_EQ(choices[0].intensity, 64.0 * 16 * 64 / (64 * 16 + 16 * 64 + 64 * 64));
  EXPECT_EQ(choices[0].reason, "intensity 11 < 20 (min_gemm_intensity)");
  EXPECT_EQ(choices[1].layer, "1.weight");
  EXPECT_TRUE(choices[1].float8);
  EXPECT_EQ(choices[1].reason, "intensity 28 >= 20 (min_gemm_intensity)");
  int64_t float8 = 0, fallbacks = 0;
  for (const OpStats& row : recorder.stats()) float8 += row.float8, fallbacks += row.float8_fallbacks;
  EXPECT_EQ(float8, 1);
  EXPECT_EQ(fallbacks, 1);
  EXPECT_EQ(gemms().sites(), 1);  // the bfloat16 layer has no float8 state
  // The first layer's output is O5's without fp8, bit for bit.
  const at::Tensor first = model[0]->as<torch::nn::Linear>()->forward(x);
  deinitialize();
  initialize(model, optimizer, quiet(O5));
  EXPECT_TRUE(BitEqual(first, model[0]->as<torch::nn::Linear>()->forward(x)));
  deinitialize();
  // Unset on a CPU: every qualifying GEMM in float8.
  initialize(model, optimizer, fp8_options());
  model->forward(x);
  choices = fp8_choices();
  ASSERT_EQ(choices.size(), 2u);
  EXPECT_TRUE(choices[0].float8 && choices[1].float8);
  EXPECT_EQ(choices[0].reason, "intensity 11 >= 0 (min_gemm_intensity)");
  deinitialize();
  initialize(model, optimizer, quiet(O5));
  EXPECT_AMP_ERROR(fp8_choices(), "needs the fp8 property");
  deinitialize();
  for (double bad : {-1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    options.fp8_scaling.min_gemm_intensity = bad;
    EXPECT_AMP_ERROR(initialize(model, optimizer, options), "min_gemm_intensity must be a finite number >= 0");
    EXPECT_FALSE(is_initialized());
  }
}

// A recomputed block quantizes its inputs again in backward, with the
// forward's scales; telemetry counts each operand once.
TEST_F(Fp8CompositionTest, ARecomputedBlockIsTalliedOnce) {
  Options options = fp8_options();
  options.precision_telemetry = true;
  torch::manual_seed(5);
  Mlp2 model;
  amp::optim::FusedAdam optimizer(model->parameters());
  initialize(model, optimizer, options);
  const at::Tensor x = torch::randn({8, 32});
  optimizer.zero_grad();
  {
    const at::Tensor out = recompute([&](const at::Tensor& h) { return model->forward(h); }, x);
    scale_loss scaled(out.to(at::kFloat).pow(2).mean(), optimizer);
    scaled.backward();
  }
  optimizer.step();
  const std::vector<Fp8TensorTelemetry> tallies = fp8_telemetry();
  ASSERT_EQ(tallies.size(), 6u);  // two layers, three operands
  for (const Fp8TensorTelemetry& t : tallies) EXPECT_EQ(t.calls, 1) << t.layer << " " << t.operand;
  EXPECT_EQ(tallies[1].layer, "fc1.weight");
  EXPECT_EQ(tallies[1].operand, "input");
  EXPECT_EQ(tallies[1].numel, 8 * 32);
}

// ---- CUDA graphs ------------------------------------------------------------------

// A whole O5+fp8 step (forward, guard, fused step, the scales' update)
// captured in a CUDA graph replays as the eager steps, bit for bit: the
// parameters, the scales and histories, an overflow skipped in the graph.
TEST_F(Fp8CompositionTest, OnCudaAStepCapturedInAGraphReplaysAsTheEagerSteps) {
  if (const std::string why = no_cuda_float8(); !why.empty()) GTEST_SKIP() << why;
  constexpr int kWarmUp = 3, kSteps = 6, kOverflowAt = 6;
  struct Outcome {
    std::vector<at::Tensor> params, scales;
    int64_t skipped = 0;
  };
  auto run = [&](bool graphed) {
    torch::manual_seed(0);
    Mlp2 model;
    model->to(torch::kCUDA);
    amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    Options options = fp8_options();
    options.loss_scale = LossScale::Dynamic(1024);
    initialize(model, optimizer, options);
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    at::Tensor x = torch::empty({16, 32}, torch::kCUDA);
    auto feed = [&](int s) {
      torch::manual_seed(s + 1);
      x.copy_(torch::randn({16, 32}));
      if (s == kOverflowAt) x[0][0].fill_(kInf);
    };
    auto step = [&] {
      optimizer.zero_grad();
      {
        scale_loss scaled(model->forward(x).to(at::kFloat).pow(2).mean(), optimizer);
        scaled.backward();
      }
      optimizer.step();
    };
    int s = 0;
    for (; s < kWarmUp; ++s) feed(s), step();
    (void)skipped_steps(optimizer);
    eager_or_replayed(graphed, s, kWarmUp + kSteps, feed, step);
    Outcome out;
    out.skipped = skipped_steps(optimizer);
    out.params = clones(model->parameters());
    for (const at::Tensor& w : {model->fc1->weight, model->fc2->weight}) {
      const auto site = gemms().site_of(w);
      for (const detail::Fp8Scaler* sc : {&site->input, &site->weight, &site->grad_output}) {
        out.scales.push_back(sc->scale().clone());
        out.scales.push_back(sc->amax_history().clone());
      }
    }
    deinitialize();
    return out;
  };
  const Outcome eager = run(false), graphed = run(true);
  EXPECT_GE(eager.skipped, 1);
  EXPECT_EQ(graphed.skipped, eager.skipped);
  for (size_t i = 0; i < eager.params.size(); ++i) EXPECT_TRUE(BitEqual(graphed.params[i], eager.params[i])) << i;
  for (size_t i = 0; i < eager.scales.size(); ++i) EXPECT_TRUE(BitEqual(graphed.scales[i], eager.scales[i])) << i;
}

}  // namespace
}  // namespace amp::testing
