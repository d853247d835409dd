// SPDX-License-Identifier: BSD-3-Clause
// Overflow provenance (overflow.h): after a skipped step amp names the
// forward op and the backward node that produced the first inf/NaN and the
// gradients that held one; healthy steps report nothing and cost no host
// sync.
#include "test_util.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

namespace amp::testing {
namespace {


// TinyNet with injection points between its layers.
struct ProbedNetImpl : torch::nn::Module {
  ProbedNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::relu(fc1(x));
    if (inject_in_backward) h = InfInBackward::apply(h);
    if (inject_in_forward) h = h * kInf;  // fc1's activations become inf/NaN
    return fc2(h);
  }
  torch::nn::Linear fc1, fc2;
  bool inject_in_backward = false, inject_in_forward = false;
};
TORCH_MODULE(ProbedNet);

Options provenance(OptLevel level) {
  Options options = level;
  options.verbosity = 0;
  options.overflow_provenance = true;
  options.loss_scale = LossScale::Dynamic();  // O4/O5 default to a static scale, which never skips
  return options;
}

std::vector<std::string> sorted(std::vector<std::string> names) {
  std::sort(names.begin(), names.end());
  return names;
}

// Two models, two losses, two optimizers (held by value), one iteration:
// both forwards (the second model's first when `second_runs_first`), then a
// guard per loss in loss order. Returns the second optimizer's report,
// amp deinitialized.
std::optional<OverflowReport> two_losses(ProbedNet& first, ProbedNet& second, bool second_runs_first) {
  torch::optim::SGD opt_first(first->parameters(), 0.01), opt_second(second->parameters(), 0.01);
  Options options = provenance(O1);
  options.num_losses = 2;
  initialize({first, second}, {opt_first, opt_second}, options);
  const auto x = torch::randn({4, 8}), y = torch::randn({4, 4});
  opt_first.zero_grad();
  opt_second.zero_grad();
  at::Tensor loss_first, loss_second;
  if (second_runs_first) loss_second = torch::mse_loss(second->forward(x).to(at::kFloat), y);
  loss_first = torch::mse_loss(first->forward(x).to(at::kFloat), y);
  if (!second_runs_first) loss_second = torch::mse_loss(second->forward(x).to(at::kFloat), y);
  {
    scale_loss scaled(loss_first, opt_first, {.loss_id = 0});
    scaled.backward();
  }
  {
    scale_loss scaled(loss_second, opt_second, {.loss_id = 1});
    scaled.backward();
  }
  opt_first.step();
  opt_second.step();
  EXPECT_FALSE(last_step_skipped(opt_first));
  EXPECT_FALSE(last_overflow(opt_first).has_value());
  std::optional<OverflowReport> report = last_overflow(opt_second);
  deinitialize();  // before the optimizers go
  return report;
}

class OverflowProvenanceTest : public AmpTest, public ::testing::WithParamInterface<OptLevel> {
 protected:
  // One iteration as users write it, the optimizer held by value.
  static void train_step(ProbedNet& model, torch::optim::SGD& optimizer, const at::Tensor& x,
                         const at::Tensor& y) {
    optimizer.zero_grad();
    const at::Tensor loss = torch::mse_loss(model->forward(x).to(at::kFloat), y);
    {
      scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
};

TEST_P(OverflowProvenanceTest, ABackwardInjectionNamesItsNodeAndTheGradientsBelowIt) {
  torch::manual_seed(0);
  ProbedNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  initialize(model, optimizer, provenance(GetParam()));
  const auto x = torch::randn({4, 8}), y = torch::randn({4, 4});

  train_step(model, optimizer, x, y);
  EXPECT_FALSE(last_step_skipped(optimizer));
  EXPECT_FALSE(last_overflow(optimizer).has_value());  // nothing overflowed yet

  const double scale = loss_scaler()->scale();
  model->inject_in_backward = true;
  train_step(model, optimizer, x, y);
  ASSERT_TRUE(last_step_skipped(optimizer));
  const std::optional<OverflowReport> report = last_overflow(optimizer);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->loss_id, 0);
  EXPECT_EQ(report->loss_scale, scale);
  ASSERT_TRUE(report->backward.has_value());
  EXPECT_NE(report->backward->op.find("InfInBackward"), std::string::npos)
      << report->backward->op;
  EXPECT_EQ(report->backward->module, "fc1");  // its gradient flows into fc1
  // fc2's gradients were computed before the injection: finite.
  EXPECT_EQ(sorted(report->non_finite_gradients), (std::vector<std::string>{"fc1.bias", "fc1.weight"}));

  // A healthy step afterwards keeps the last report and adds none.
  model->inject_in_backward = false;
  train_step(model, optimizer, x, y);
  EXPECT_FALSE(last_step_skipped(optimizer));
  EXPECT_EQ(last_overflow(optimizer)->non_finite_gradients.size(), 2u);
}

TEST_P(OverflowProvenanceTest, OneParametersGradientIsNamedAndNoNodeIsBlamed) {
  torch::manual_seed(0);
  ProbedNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  initialize(model, optimizer, provenance(GetParam()));
  const auto x = torch::randn({4, 8}), y = torch::randn({4, 4});
  // The program's own hook makes one gradient non-finite after backward's
  // nodes produced it.
  model->fc2->bias.register_hook([](const at::Tensor& g) { return g * kInf; });
  train_step(model, optimizer, x, y);
  ASSERT_TRUE(last_step_skipped(optimizer));
  const std::optional<OverflowReport> report = last_overflow(optimizer);
  ASSERT_TRUE(report.has_value());
  EXPECT_FALSE(report->backward.has_value()) << report->backward->op;
  EXPECT_EQ(report->non_finite_gradients, (std::vector<std::string>{"fc2.bias"}));
}

TEST_P(OverflowProvenanceTest, AForwardInjectionNamesItsOpAndModule) {
  torch::manual_seed(0);
  ProbedNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  initialize(model, optimizer, provenance(GetParam()));
  const auto x = torch::randn({4, 8}), y = torch::randn({4, 4});
  train_step(model, optimizer, x, y);
  const at::ScalarType activation_dtype = torch::relu(model->fc1(x)).scalar_type();

  model->inject_in_forward = true;
  train_step(model, optimizer, x, y);
  ASSERT_TRUE(last_step_skipped(optimizer));
  const std::optional<OverflowReport> report = last_overflow(optimizer);
  ASSERT_TRUE(report.has_value());
  ASSERT_TRUE(report->forward.has_value());
  EXPECT_EQ(report->forward->op, "aten::mul.Scalar");  // h * inf; the ops before it were finite
  EXPECT_EQ(report->forward->module, "fc1");
  EXPECT_EQ(report->forward->dtype, activation_dtype);
  EXPECT_FALSE(report->forward->input_non_finite);
  // Backward: the loss's gradient is finite until the loss node multiplies
  // it by its NaN input; every node after reads NaN.
  ASSERT_TRUE(report->backward.has_value());
  EXPECT_EQ(report->backward->op, "MseLossBackward0");
}

TEST_P(OverflowProvenanceTest, ANonFiniteParameterIsNamedAsTheInputOfTheOpThatReadIt) {
  torch::manual_seed(0);
  ProbedNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  initialize(model, optimizer, provenance(GetParam()));
  const auto x = torch::randn({4, 8}), y = torch::randn({4, 4});
  {
    torch::NoGradGuard no_grad;
    model->fc2->bias[1].fill_(kInf);  // the model's own (at O2/O5 low-precision) parameter
  }
  train_step(model, optimizer, x, y);
  ASSERT_TRUE(last_step_skipped(optimizer));
  const std::optional<OverflowReport> report = last_overflow(optimizer);
  ASSERT_TRUE(report.has_value() && report->forward.has_value());
  EXPECT_EQ(report->forward->op, "aten::addmm");  // LibTorch's Linear on a matrix
  EXPECT_EQ(report->forward->module, "fc2");
  EXPECT_TRUE(report->forward->input_non_finite);
}

INSTANTIATE_TEST_SUITE_P(Levels, OverflowProvenanceTest, ::testing::Values(O1, O2, O4, O5),
                         [](const auto& info) { return to_string(info.param); });

TEST_F(AmpTest, OverflowProvenanceNamesTheModuleOfTheNodeAndLogsIt) {
  torch::manual_seed(0);
  TinyNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  Options options = provenance(O1);
  options.verbosity = 1;
  LogRecorder log;
  initialize(model, optimizer, options);
  const auto x = torch::randn({4, 8});
  optimizer.zero_grad();
  // An output gradient of inf reaches fc2's matmul first: the first node
  // that makes non-finite gradients from finite ones is fc2's own.
  const at::Tensor out = model->forward(x);
  const at::Tensor loss = (out.to(at::kFloat) * torch::tensor({1.0f, 1.0f, 1.0f, 3e38f})).sum();
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
  const std::optional<OverflowReport> report = last_overflow(optimizer);
  ASSERT_TRUE(report.has_value());
  ASSERT_TRUE(report->backward.has_value());
  EXPECT_EQ(report->backward->op, "MulBackward0");  // 3e38 * 65536 overflows float32
  EXPECT_EQ(report->backward->module, "fc2");
  EXPECT_EQ(report->backward->dtype, at::kFloat);
  std::string logged;
  for (const LogEvent& e : log.take()) {
    if (e.kind == LogEvent::Kind::kStepSkipped) logged = e.message;
  }
  EXPECT_NE(logged.find("First inf/NaN produced in backward: MulBackward0 (module fc2, Float)"),
            std::string::npos) << logged;
  EXPECT_NE(logged.find("fc2.weight"), std::string::npos) << logged;
}

TEST_F(AmpTest, AStepThatFusedKernelsSkipOnTheDeviceReportsTheSame) {
  torch::manual_seed(0);
  ProbedNet model;
  amp::optim::FusedAdam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  Options options = provenance(O2);
  options.precision_telemetry = true;
  initialize(model, optimizer, options);
  const auto x = torch::randn({4, 8}), y = torch::randn({4, 4});
  model->inject_in_forward = true;
  optimizer.zero_grad();
  const at::Tensor loss = torch::mse_loss(model->forward(x).to(at::kFloat), y);
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();  // the kernels take the verdict on the device
  ASSERT_TRUE(last_step_skipped(optimizer));
  const std::optional<OverflowReport> report = last_overflow(optimizer);
  ASSERT_TRUE(report.has_value() && report->forward.has_value() && report->backward.has_value());
  EXPECT_EQ(report->forward->op, "aten::mul.Scalar");
  EXPECT_EQ(report->forward->module, "fc1");
  EXPECT_EQ(report->backward->op, "MseLossBackward0");
  const std::optional<PrecisionTelemetry> telemetry = precision_telemetry(optimizer);
  ASSERT_TRUE(telemetry.has_value());
  EXPECT_FALSE(std::isfinite(telemetry->groups.at(0).amax));  // the step's gradients held NaN
}

TEST_F(AmpTest, AFloat16CastThatOverflowsIsNamedAtTheOpThatCast) {
  torch::manual_seed(0);
  ProbedNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  Options options = provenance(O1);
  options.cpu_dtype = at::kHalf;
  initialize(model, optimizer, options);
  const auto x = torch::full({4, 8}, 1e5f), y = torch::randn({4, 4});  // finite in float32, not in float16
  const at::Tensor loss = torch::mse_loss(model->forward(x).to(at::kFloat), y);
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
  const std::optional<OverflowReport> report = last_overflow(optimizer);
  ASSERT_TRUE(report.has_value() && report->forward.has_value());
  EXPECT_EQ(report->forward->op, "aten::addmm");
  EXPECT_EQ(report->forward->module, "fc1");
  EXPECT_EQ(report->forward->dtype, at::kHalf);
  EXPECT_FALSE(report->forward->input_non_finite);  // it read finite float32 and cast it
}

TEST_F(AmpTest, ForwardRecordsStayWithTheLossWhoseGraphHoldsThem) {
  torch::manual_seed(0);
  ProbedNet first, second;
  second->inject_in_forward = true;
  // The second model runs first: the first guard must leave its records.
  const std::optional<OverflowReport> report = two_losses(first, second, /*second_runs_first=*/true);
  ASSERT_TRUE(report.has_value() && report->forward.has_value());
  EXPECT_EQ(report->loss_id, 1);
  EXPECT_EQ(report->forward->op, "aten::mul.Scalar");
  EXPECT_EQ(report->forward->module, "model1.fc1");
}

TEST_F(AmpTest, ForwardWatchKernelsLeaveWithTheContext) {
  const auto relu = c10::Dispatcher::singleton().findOp({"aten::relu", ""});
  ASSERT_TRUE(relu.has_value());
  EXPECT_FALSE(relu->hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU));
  TinyNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  initialize(model, optimizer, provenance(O1));
  EXPECT_TRUE(relu->hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU));
  deinitialize();
  EXPECT_FALSE(relu->hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU));
  Options off = provenance(O1);
  off.overflow_provenance = false;
  initialize(model, optimizer, off);
  EXPECT_FALSE(relu->hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU));  // off: no watch kernels
}

// Counts reads of a tensor's value to the host (Tensor::item and the like),
// on any thread, while it lives.
class HostReadCounter {
 public:
  HostReadCounter()
      : handle_(at::addGlobalCallback(at::RecordFunctionCallback(&on_call).needsInputs(false))) {
    count_ = 0;
  }
  ~HostReadCounter() { at::removeCallback(handle_); }
  int64_t count() const { return count_.load(); }

 private:
  static std::unique_ptr<at::ObserverContext> on_call(const at::RecordFunction& fn) {
    if (std::string_view(fn.name()) == "aten::_local_scalar_dense") ++count_;
    return nullptr;
  }
  static inline std::atomic<int64_t> count_{0};
  at::CallbackHandle handle_;
};

TEST_F(AmpTest, OverflowProvenanceAddsNoHostSyncToHealthySteps) {
  auto syncs_over_healthy_steps = [&](bool provenance_on) {
    torch::manual_seed(0);
    ProbedNet model;
    torch::optim::SGD optimizer(model->parameters(), 0.01);
    Options options = provenance(O2);
    options.overflow_provenance = provenance_on;
    options.precision_telemetry = provenance_on;
    Handle handle;
    handle.initialize(model, optimizer, options);
    const auto x = torch::randn({4, 8}), y = torch::randn({4, 4});
    const int64_t before = host_syncs();
    HostReadCounter reads;
    for (int i = 0; i < 5; ++i) {
      optimizer.zero_grad();
      const at::Tensor loss = torch::mse_loss(model->forward(x).to(at::kFloat), y);
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
    }
    EXPECT_FALSE(last_overflow(optimizer).has_value());
    EXPECT_EQ(reads.count(), 0) << "provenance " << provenance_on;
    return host_syncs() - before;
  };
  EXPECT_EQ(syncs_over_healthy_steps(true), syncs_over_healthy_steps(false));
}

TEST_F(AmpTest, OverflowProvenanceReportsPerLossAndOptimizer) {
  torch::manual_seed(0);
  ProbedNet first, second;
  second->inject_in_backward = true;
  const std::optional<OverflowReport> report = two_losses(first, second, /*second_runs_first=*/false);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->loss_id, 1);
  EXPECT_EQ(sorted(report->non_finite_gradients),
            (std::vector<std::string>{"model1.fc1.bias", "model1.fc1.weight"}));
}

// ---- Precision telemetry (telemetry.h) -------------------------------------

// A float32 elementwise weight whose gradient spans 40 decades (x does),
// computed in float32, before a linear layer.
struct SpreadNetImpl : torch::nn::Module {
  SpreadNetImpl()
      : w(register_parameter("w", torch::ones({256}))), fc(register_module("fc", torch::nn::Linear(256, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(x * w); }
  torch::Tensor w;
  torch::nn::Linear fc;
};
TORCH_MODULE(SpreadNet);

// Inputs whose column j has magnitude 10^(-40 j / 255), signs mixed.
at::Tensor spread_inputs() {
  const at::Tensor magnitude = at::pow(10.0, at::linspace(0, -40, 256, at::kDouble)).to(at::kFloat);
  return magnitude * torch::randn({8, 256}).sign();
}

// The same figures, computed in float64 from the gradient a guard left:
// nonzero elements whose scaled value is at most half the low dtype's
// smallest subnormal (round to nearest even takes them to zero).
struct Float64Figures {
  int64_t underflow = 0, zeros = 0;
  double amax = 0;
};
Float64Figures float64_figures(const at::Tensor& grad, double scale, at::ScalarType low) {
  const double smallest_subnormal = low == at::kHalf ? std::ldexp(1.0, -24) : std::ldexp(1.0, -133);
  const at::Tensor g = grad.to(at::kDouble), scaled = (g * scale).abs();
  return {(scaled <= smallest_subnormal / 2).logical_and(g != 0).sum().item<int64_t>(), (g == 0).sum().item<int64_t>(),
          g.abs().max().item<double>()};
}

class PrecisionTelemetryTest : public AmpTest, public ::testing::WithParamInterface<OptLevel> {};

TEST_P(PrecisionTelemetryTest, UnderflowZerosAndAmaxEqualFloat64s) {
  torch::manual_seed(0);
  SpreadNet model;
  torch::optim::SGD optimizer(model->parameters(), 1e-3);
  Options options = GetParam();
  options.verbosity = 0;
  options.precision_telemetry = true;
  const bool float16_levels = GetParam() == O1 || GetParam() == O2;
  if (float16_levels) options.cpu_dtype = at::kHalf;  // O4/O5 are bfloat16 only
  options.keep_fp32 = [](const torch::nn::Module& m) { return m.name() == "SpreadNetImpl"; };  // w: float32
  initialize(model, optimizer, options);
  EXPECT_FALSE(precision_telemetry(optimizer).has_value());  // no guard yet
  const at::ScalarType low = float16_levels ? at::kHalf : at::kBFloat16;
  const auto x = spread_inputs(), y = torch::randn({8, 4});
  for (int step = 0; step < 3; ++step) {
    const double scale = loss_scaler()->scale();
    optimizer.zero_grad();
    const at::Tensor loss = torch::mse_loss(model->forward(x).to(at::kFloat), y);
    {
      scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    const std::optional<PrecisionTelemetry> t = precision_telemetry(optimizer);
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->loss_scale, scale);
    ASSERT_EQ(t->groups.size(), 1u);
    const GroupTelemetry& group = t->groups[0];
    int64_t numel = 0, underflow = 0;
    std::map<std::string, at::Tensor> grads;
    for (const auto& item : model->named_parameters()) grads[item.key()] = item.value().grad();
    ASSERT_EQ(group.parameters.size(), grads.size());
    for (const ParameterTelemetry& p : group.parameters) {
      ASSERT_TRUE(grads.count(p.name)) << p.name;
      const Float64Figures expected = float64_figures(grads[p.name], scale, low);
      EXPECT_EQ(p.numel, grads[p.name].numel()) << p.name;
      EXPECT_EQ(p.underflow, expected.underflow) << p.name;
      EXPECT_EQ(p.zeros, expected.zeros) << p.name;
      EXPECT_EQ(p.amax, expected.amax) << p.name;
      numel += p.numel;
      underflow += p.underflow;
    }
    EXPECT_EQ(group.numel, numel);
    EXPECT_EQ(group.underflow, underflow);
    const auto w = std::find_if(group.parameters.begin(), group.parameters.end(),
                                [](const ParameterTelemetry& p) { return p.name == "w"; });
    ASSERT_NE(w, group.parameters.end());
    EXPECT_GT(w->underflow, 0);            // the spread reaches below the floor at any scale
    EXPECT_LT(w->underflow, w->numel);
    optimizer.step();
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, PrecisionTelemetryTest, ::testing::Values(O1, O2, O4, O5),
                         [](const auto& info) { return to_string(info.param); });

TEST_F(AmpTest, ScaleHistoryHoldsTheScaleOfEveryBackward) {
  torch::manual_seed(0);
  ProbedNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.01);
  Options options = provenance(O1);
  options.overflow_provenance = false;
  options.precision_telemetry = true;
  options.loss_scale = LossScale::Dynamic(1024);
  options.dynamic_scaling = DynamicScaling{.growth_interval = 2};
  initialize(model, optimizer, options);
  const auto x = torch::randn({4, 8}), y = torch::randn({4, 4});
  std::vector<double> seen;
  for (int step = 0; step < 7; ++step) {
    seen.push_back(loss_scaler()->scale());
    model->inject_in_forward = step == 3;  // one overflow: the scale halves
    optimizer.zero_grad();
    const at::Tensor loss = torch::mse_loss(model->forward(x).to(at::kFloat), y);
    {
      scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
  EXPECT_EQ(scale_history(), seen);
  EXPECT_EQ(seen, (std::vector<double>{1024, 1024, 2048, 2048, 1024, 1024, 2048}));
}

TEST_F(AmpTest, PrecisionTelemetrySaysHowToTurnItOn) {
  TinyNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.1), stranger(model->parameters(), 0.1);
  initialize(model, optimizer, quiet(O1));
  EXPECT_AMP_ERROR(precision_telemetry(optimizer), "Options::precision_telemetry = true");
  EXPECT_AMP_ERROR(scale_history(), "Options::precision_telemetry = true");
  deinitialize();
  Options options = quiet(O1);
  options.precision_telemetry = true;
  initialize(model, optimizer, options);
  EXPECT_AMP_ERROR(precision_telemetry(stranger), "not passed to the live amp::initialize");
  EXPECT_AMP_ERROR(scale_history(1), "num_losses=1");
  EXPECT_TRUE(scale_history().empty());
}

TEST_F(AmpTest, LastOverflowNeedsAnOptimizerAmpKnows) {
  EXPECT_AMP_ERROR(last_overflow(std::make_shared<torch::optim::SGD>(TinyNet()->parameters(), 0.1)),
                   "needs amp to be initialized");
  auto model = TinyNet();
  torch::optim::SGD optimizer(model->parameters(), 0.1), stranger(model->parameters(), 0.1);
  initialize(model, optimizer, provenance(O1));
  EXPECT_AMP_ERROR(last_overflow(stranger), "not passed to the live amp::initialize");
}

}  // namespace
}  // namespace amp::testing
