// The gradient lifecycle in the loops users write, checked by value against
// plain LibTorch in float64: Apex's L0 multi-model scenarios, a GAN, zeroing
// through the model, the optimizer or not at all, LR schedulers, exceptions
// inside guards, and float32 inputs meeting low-precision parameter layers.
#include "test_util.h"

#include <ATen/autocast_mode.h>
#include <torch/optim/schedulers/step_lr.h>

#include <limits>

namespace amp::testing {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// --- Apex's L0 multi-model scenarios (tests/L0/run_amp) ---------------------

// Apex's MyModel: loss = sum(x * w0 * w1) with x = ones(2), w0 = [u, u+1],
// w1 = [u+1, u+2]. Every gradient, momentum and update on these small grid
// values is exact in float16, so amp must match float64 bit for bit.
struct ApexModelImpl : torch::nn::Module {
  ApexModelImpl(double u, torch::Dtype dtype)
      : w0(register_parameter("w0", torch::arange(2, dtype) + u)),
        w1(register_parameter("w1", torch::arange(2, dtype) + u + 1)) {}
  torch::Tensor forward() {
    const auto x = torch::ones({2}, w0.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat);
    return (x * w0 * w1).sum();
  }
  torch::Tensor w0, w1;
};
TORCH_MODULE(ApexModel);

struct GroupSpec {
  int model;
  double lr;
};
struct OptimizerSpec {
  std::vector<GroupSpec> groups;
  double momentum;
};
struct LossSpec {
  std::vector<int> models;      // the loss is the sum of these models' outputs
  std::vector<int> optimizers;  // the optimizers its guard covers
};
struct Scenario {
  std::string name;
  std::vector<double> u;
  std::vector<OptimizerSpec> optimizers;
  std::vector<LossSpec> losses;
};

const std::vector<Scenario>& scenarios() {
  static const std::vector<Scenario> s = {
      {"2models2losses1optimizer", {1, 2}, {{{{0, 0.25}, {1, 0.5}}, 0.125}}, {{{0}, {0}}, {{1}, {0}}}},
      {"3models2losses1optimizer", {1, 2, 3}, {{{{0, 0.25}, {1, 0.5}, {2, 0.125}}, 0.125}},
       {{{0, 2}, {0}}, {{1, 2}, {0}}}},
      {"2models2losses2optimizers", {1, 2}, {{{{0, 0.25}}, 0.125}, {{{1, 0.5}}, 0.25}},
       {{{0}, {0}}, {{1}, {1}}}},
      {"3models2losses2optimizers", {1, 2, 3}, {{{{0, 0.25}, {1, 1.0}}, 0.5}, {{{2, 0.5}}, 0.25}},
       {{{0, 1}, {0}}, {{2, 1}, {0, 1}}}},
  };
  return s;
}

enum class Zero { kOptimizer, kModel, kNever };
const char* to_string(Zero z) {
  return z == Zero::kOptimizer ? "ZeroOptimizer" : z == Zero::kModel ? "ZeroModel" : "NeverZero";
}

struct Case {
  int scenario;
  OptLevel level;
  Zero zero;
  bool separate_scalers;  // num_losses=2 (loss_id 0, 1) or one shared scaler
  int inject_in_loss;     // -1: none; else inf in that loss's gradients at iteration 1
};

constexpr int kIterations = 3;
constexpr int kInjectAt = 1;

std::vector<std::shared_ptr<torch::optim::Optimizer>> make_optimizers(const Scenario& s,
                                                                      const std::vector<ApexModel>& models) {
  std::vector<std::shared_ptr<torch::optim::Optimizer>> out;
  for (const auto& spec : s.optimizers) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (const auto& g : spec.groups) {
      groups.emplace_back(models[g.model]->parameters(),
                          std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(g.lr).momentum(spec.momentum)));
    }
    out.push_back(std::make_shared<torch::optim::SGD>(groups, torch::optim::SGDOptions(0.1).momentum(spec.momentum)));
  }
  return out;
}

bool covers(const LossSpec& loss, size_t optimizer) {
  return std::find(loss.optimizers.begin(), loss.optimizers.end(), static_cast<int>(optimizer)) != loss.optimizers.end();
}

std::vector<at::Tensor> grads_of(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) out.push_back(p.grad().defined() ? p.grad().to(torch::kDouble).clone() : at::Tensor());
  }
  return out;
}

// Which optimizers' gradients the injected loss's guard discards at
// `iteration`: those it covers. LibTorch's SGD steps whatever gradients it
// holds, so one that a later loss's guard covers too steps on those.
std::vector<bool> discarded_at(const Scenario& s, const Case& c, int iteration, size_t after_loss) {
  std::vector<bool> discard(s.optimizers.size(), false);
  if (c.inject_in_loss == static_cast<int>(after_loss) && iteration == kInjectAt) {
    for (int o : s.losses[after_loss].optimizers) discard[o] = true;
  }
  return discard;
}
std::vector<bool> skipped_at(const Scenario& s, const Case& c, int iteration) {
  std::vector<bool> skip(s.optimizers.size(), false);
  for (size_t l = 0; l < s.losses.size(); ++l) {
    const auto discard = discarded_at(s, c, iteration, l);
    for (size_t o = 0; o < skip.size(); ++o) skip[o] = discard[o] || (skip[o] && !covers(s.losses[l], o));
  }
  return skip;
}

struct Trace {
  std::vector<std::vector<std::vector<at::Tensor>>> grads;  // [iteration][optimizer][param]
  std::vector<at::Tensor> params;                           // final values, model order
};

// Plain LibTorch in float64: the same losses, zeroing as the user's loop
// does; gradients an overflow discards dropped, skipped steps not taken.
Trace reference_run(const Scenario& s, const Case& c) {
  std::vector<ApexModel> models;
  for (double u : s.u) models.emplace_back(u, torch::kDouble);
  auto optimizers = make_optimizers(s, models);
  Trace trace;
  for (int it = 0; it < kIterations; ++it) {
    if (c.zero != Zero::kNever) {
      for (auto& o : optimizers) o->zero_grad();
    }
    for (size_t l = 0; l < s.losses.size(); ++l) {
      const LossSpec& loss = s.losses[l];
      at::Tensor total = models[loss.models[0]]->forward();
      for (size_t i = 1; i < loss.models.size(); ++i) total = total + models[loss.models[i]]->forward();
      total.backward();
      const auto discard = discarded_at(s, c, it, l);
      for (size_t o = 0; o < optimizers.size(); ++o) {
        if (discard[o]) optimizers[o]->zero_grad();
      }
    }
    trace.grads.emplace_back();
    for (auto& o : optimizers) trace.grads.back().push_back(grads_of(*o));
    const auto skip = skipped_at(s, c, it);
    for (size_t o = 0; o < optimizers.size(); ++o) {
      if (!skip[o]) optimizers[o]->step();
    }
  }
  for (auto& m : models) {
    trace.params.push_back(m->w0.detach().clone());
    trace.params.push_back(m->w1.detach().clone());
  }
  return trace;
}

class ApexScenarioTest : public AmpTest, public ::testing::WithParamInterface<Case> {};

TEST_P(ApexScenarioTest, GradientsAndParametersEqualFloat64) {
  const Case c = GetParam();
  const Scenario& s = scenarios()[c.scenario];
  const Trace expected = reference_run(s, c);

  std::vector<ApexModel> models;
  std::vector<ModulePtr> modules;
  for (double u : s.u) {
    models.emplace_back(u, torch::kFloat);
    modules.push_back(models.back().ptr());
  }
  Options options = quiet(c.level);
  options.cpu_dtype = at::kHalf;  // every value here is exact in float16
  options.num_losses = c.separate_scalers ? 2 : 1;
  if (resolve_properties(c.level, {}).loss_scale.dynamic) options.loss_scale = LossScale::Dynamic(4);
  const auto optimizers = make_optimizers(s, models);
  Handle handle;
  handle.initialize(modules, optimizers, options);

  for (int it = 0; it < kIterations; ++it) {
    if (c.zero == Zero::kOptimizer) {
      for (auto& o : optimizers) o->zero_grad();
    } else if (c.zero == Zero::kModel) {
      for (auto& m : models) m->zero_grad();
    }
    for (size_t l = 0; l < s.losses.size(); ++l) {
      const LossSpec& loss = s.losses[l];
      at::Tensor total = models[loss.models[0]]->forward();
      for (size_t i = 1; i < loss.models.size(); ++i) total = total + models[loss.models[i]]->forward();
      std::vector<OptimizerPtr> covered;
      for (int o : loss.optimizers) covered.push_back(optimizers[o]);
      scale_loss scaled(total, covered, {c.separate_scalers ? static_cast<int>(l) : 0});
      scaled.backward();
      if (c.inject_in_loss == static_cast<int>(l) && it == kInjectAt) {
        models[loss.models.back()]->w1.grad()[0].fill_(kInf);
      }
    }
    if (it != kInjectAt || c.inject_in_loss < 0) {
      for (size_t o = 0; o < optimizers.size(); ++o) {
        const auto got = grads_of(*optimizers[o]);
        ASSERT_EQ(got.size(), expected.grads[it][o].size());
        for (size_t p = 0; p < got.size(); ++p) {
          EXPECT_TRUE(BitEqual(got[p], expected.grads[it][o][p])) << "iteration " << it << " optimizer " << o << " param " << p;
        }
      }
    }
    const auto skip = skipped_at(s, c, it);
    for (size_t o = 0; o < optimizers.size(); ++o) {
      optimizers[o]->step();
      EXPECT_EQ(last_step_skipped(*optimizers[o]), skip[o]) << "iteration " << it << " optimizer " << o;
    }
  }
  for (size_t m = 0; m < models.size(); ++m) {
    const auto dtype = models[m]->w0.scalar_type();
    EXPECT_TRUE(BitEqual(models[m]->w0, expected.params[2 * m].to(dtype))) << "model " << m << " w0";
    EXPECT_TRUE(BitEqual(models[m]->w1, expected.params[2 * m + 1].to(dtype))) << "model " << m << " w1";
  }
}

std::vector<Case> apex_cases() {
  std::vector<Case> out;
  for (int s = 0; s < static_cast<int>(scenarios().size()); ++s) {
    for (OptLevel level : {O0, O1, O2, O3}) {
      for (Zero zero : {Zero::kOptimizer, Zero::kModel, Zero::kNever}) {
        for (bool separate : {false, true}) {
          out.push_back({s, level, zero, separate, -1});
          const bool dynamic = level == O1 || level == O2;  // static scales never skip
          if (!dynamic) continue;
          for (int loss : {0, 1}) out.push_back({s, level, zero, separate, loss});
        }
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Apex, ApexScenarioTest, ::testing::ValuesIn(apex_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Case& c = info.param;
                           std::string name = scenarios()[c.scenario].name + "_" + to_string(c.level) + "_" +
                                              to_string(c.zero) + (c.separate_scalers ? "_TwoScalers" : "_OneScaler");
                           if (c.inject_in_loss >= 0) name += "_InfInLoss" + std::to_string(c.inject_in_loss);
                           return name;
                         });

// --- A GAN: two models, two optimizers, three losses -------------------------

// Linear generator and discriminator on a 1/4 grid. The generator's loss
// backpropagates through the discriminator, leaving low-precision gradients
// scaled by loss 2's scale on the discriminator's model parameters.
struct GanModels {
  torch::nn::Linear g{torch::nn::LinearOptions(2, 2).bias(false)};
  torch::nn::Linear d{torch::nn::LinearOptions(2, 1).bias(false)};
  explicit GanModels(torch::Dtype dtype) {
    torch::NoGradGuard no_grad;
    g->weight.copy_(torch::tensor({{0.5, -0.25}, {0.25, 0.5}}));
    d->weight.copy_(torch::tensor({{0.5, -0.75}}));
    g->to(dtype);
    d->to(dtype);
  }
};

at::Tensor gan_real(int it) { return torch::tensor({{1.0, 2.0}, {-1.0, 0.5}, {0.5, -2.0}, {2.0, 1.0}}) + it * 0.25; }
at::Tensor gan_noise(int it) { return torch::tensor({{1.0, -1.0}, {0.5, 2.0}, {-2.0, 1.0}, {1.0, 0.5}}) - it * 0.25; }

struct GanCase {
  OptLevel level;
  Zero zero;
  bool inject;  // inf in the fake loss's gradients at iteration 1: D skips there
};

class GanTest : public AmpTest, public ::testing::WithParamInterface<GanCase> {};

TEST_P(GanTest, MasterGradientsAndParametersMatchFloat64) {
  const GanCase c = GetParam();
  GanModels ref(torch::kDouble), amp_models(torch::kFloat);
  torch::optim::SGD ref_g(ref.g->parameters(), 0.125), ref_d(ref.d->parameters(), 0.25);
  OptimizerPtr opt_g = std::make_shared<torch::optim::SGD>(amp_models.g->parameters(), 0.125);
  OptimizerPtr opt_d = std::make_shared<torch::optim::SGD>(amp_models.d->parameters(), 0.25);
  Options options = quiet(c.level);
  options.num_losses = 3;
  Handle handle;
  handle.initialize({amp_models.g, amp_models.d}, {opt_g, opt_d}, options);
  // bf16 rounds the 1/4-grid products of three iterations; fp16 and fp32 do not.
  const double tolerance = properties().low_precision_dtype(c10::kCPU) == at::kBFloat16 ? 1e-2 : 1e-6;
  auto expect_close = [&](const at::Tensor& got, const at::Tensor& want, const std::string& what) {
    ASSERT_TRUE(got.defined()) << what;
    EXPECT_TRUE(torch::allclose(got.to(torch::kDouble), want, tolerance, tolerance))
        << what << ": got " << got << " want " << want;
  };

  for (int it = 0; it < kIterations; ++it) {
    const bool d_skips = c.inject && it == kInjectAt;
    // Reference: plain float64 LibTorch.
    const auto ref_fake = ref.g(gan_noise(it).to(torch::kDouble));
    ref_d.zero_grad();
    ref.d(gan_real(it).to(torch::kDouble)).mean().backward();
    (-ref.d(ref_fake.detach())).mean().backward();
    const auto ref_d_grad = ref.d->weight.grad().clone();
    if (!d_skips) ref_d.step();
    ref_g.zero_grad();
    (-ref.d(ref_fake)).mean().backward();
    ref_g.step();

    // amp: the same loop.
    const auto fake = amp_models.g(gan_noise(it));
    if (c.zero == Zero::kOptimizer) opt_d->zero_grad(); else amp_models.d->zero_grad();
    {
      scale_loss scaled(amp_models.d(gan_real(it)).mean(), opt_d, {0});
      scaled.backward();
    }
    {
      scale_loss scaled((-amp_models.d(fake.detach())).mean(), opt_d, {1});
      scaled.backward();
      if (d_skips) amp_models.d->weight.grad()[0][0].fill_(kInf);
    }
    if (!d_skips) expect_close(master_params(*opt_d)[0].grad(), ref_d_grad, "D gradient, iteration " + std::to_string(it));
    opt_d->step();
    EXPECT_EQ(last_step_skipped(*opt_d), d_skips);
    if (c.zero == Zero::kOptimizer) opt_g->zero_grad(); else amp_models.g->zero_grad();
    {
      scale_loss scaled((-amp_models.d(fake)).mean(), opt_g, {2});
      scaled.backward();
    }
    expect_close(master_params(*opt_g)[0].grad(), ref.g->weight.grad(), "G gradient, iteration " + std::to_string(it));
    opt_g->step();
    expect_close(master_params(*opt_d)[0], ref.d->weight.detach(), "D weight, iteration " + std::to_string(it));
    expect_close(master_params(*opt_g)[0], ref.g->weight.detach(), "G weight, iteration " + std::to_string(it));
  }
  EXPECT_EQ(skipped_steps(*opt_d), c.inject ? 1 : 0);
  EXPECT_EQ(skipped_steps(*opt_g), 0);
}

INSTANTIATE_TEST_SUITE_P(Levels, GanTest,
                         ::testing::Values(GanCase{O1, Zero::kOptimizer, false}, GanCase{O2, Zero::kOptimizer, false},
                                           GanCase{O2, Zero::kModel, false}, GanCase{O2, Zero::kOptimizer, true},
                                           GanCase{O2, Zero::kModel, true}, GanCase{O5, Zero::kOptimizer, false},
                                           GanCase{O5, Zero::kModel, false}, GanCase{O3, Zero::kOptimizer, false}),
                         [](const ::testing::TestParamInfo<GanCase>& info) {
                           return std::string(to_string(info.param.level)) + "_" + to_string(info.param.zero) +
                                  (info.param.inject ? "_InfInFakeLoss" : "");
                         });

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
  if (resolve_properties(level, {}).loss_scale.dynamic) options.loss_scale = LossScale::Dynamic(4);
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

// --- Exceptions inside guards; when a queued skip applies --------------------

class GuardUnwindTest : public AmpTest, public ::testing::WithParamInterface<OptLevel> {};

TEST_P(GuardUnwindTest, ExceptionAfterUnscaleRestoresGradientsAndScaler) {
  torch::manual_seed(0);
  auto model = TinyNet();
  auto reference = TinyNet();
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model->parameters().size(); ++i) reference->parameters()[i].copy_(model->parameters()[i]);
  }
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  OptimizerPtr ref_optimizer = std::make_shared<torch::optim::SGD>(reference->parameters(), 0.1);
  Options options = quiet(GetParam());
  options.dynamic_scaling.growth_interval = 1;  // a clean guard would grow the scale
  options.num_losses = 2;                       // loss 1: the reference's own scaler
  Handle handle;
  handle.initialize({model, reference}, {optimizer, ref_optimizer}, options);
  const auto x = torch::randn({3, 8});
  for (int id : {0, 1}) {
    auto [m, o] = id == 0 ? std::pair{model, optimizer} : std::pair{reference, ref_optimizer};
    o->zero_grad();
    scale_loss scaled(m->forward(x).to(at::kFloat).sum(), o, {id});
    scaled.backward();
  }
  std::vector<at::Tensor> before;
  for (const auto& p : master_params(*optimizer)) before.push_back(p.grad().clone());
  const LossScaler::State scaler_before = loss_scaler().state();
  try {
    scale_loss scaled(model->forward(x * 2).to(at::kFloat).sum(), optimizer);
    scaled.backward();
    scaled.unscale();
    throw std::runtime_error("clipping rejected the gradients");
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "clipping rejected the gradients");
  }
  const auto params = master_params(*optimizer);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(BitEqual(params[i].grad(), before[i])) << "param " << i;
  EXPECT_TRUE(BitEqual(loss_scaler().state().scale, scaler_before.scale));
  EXPECT_TRUE(BitEqual(loss_scaler().state().growth_tracker, scaler_before.growth_tracker));
  optimizer->step();
  ref_optimizer->step();
  EXPECT_FALSE(last_step_skipped(*optimizer));
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(BitEqual(model->parameters()[i], reference->parameters()[i])) << "param " << i;
  }
}

TEST_P(GuardUnwindTest, QueuedSkipDoesNotOutliveTheGradientsItJudged) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(GetParam()));
  const auto x = torch::randn({3, 8});
  {
    scale_loss scaled(model->forward(x).to(at::kFloat).sum(), optimizer);
    scaled.backward();
    model->fc1->weight.grad()[0][0].fill_(kInf);
  }
  // The user's code fails between the guard and step(); the loop catches it,
  // zeroes and goes on: the overflowed gradients are gone, so is their skip.
  for (bool through_model : {false, true}) {
    if (through_model) model->zero_grad(); else optimizer->zero_grad();
    const auto before = model->fc2->weight.detach().clone();
    {
      scale_loss scaled(model->forward(x).to(at::kFloat).sum(), optimizer);
      scaled.backward();
    }
    optimizer->step();
    EXPECT_FALSE(last_step_skipped(*optimizer));
    EXPECT_FALSE(BitEqual(model->fc2->weight, before)) << "the clean step must be taken";
  }
  // The overflow cost one step: its guard discarded the gradients it judged.
  EXPECT_EQ(skipped_steps(*optimizer), resolve_properties(GetParam(), {}).loss_scale.dynamic ? 1 : 0);
}

INSTANTIATE_TEST_SUITE_P(Levels, GuardUnwindTest, ::testing::Values(O1, O2, O5),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST_F(GuardUnwindTest, FinishEndsTheGuardWhereErrorsAreExpected) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O2));
  scale_loss scaled(model->forward(torch::randn({3, 8})).to(at::kFloat).sum(), optimizer);
  scaled.backward();
  scaled.finish();
  EXPECT_EQ(model->fc1->weight.scalar_type(), at::kFloat) << "the masters rest";
  EXPECT_EQ(model->fc1->weight.grad().scalar_type(), at::kFloat) << "with their float32 gradients";
  EXPECT_AMP_ERROR(scaled.finish(), "already called");
  EXPECT_AMP_ERROR(scaled.unscale(), "has finished");
  optimizer->step();  // the guard is over even though its scope is not
}

TEST_F(GuardUnwindTest, BackwardOutsideTheGuardAtO2IsAClearErrorAtTheNextGuard) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O2));
  model->forward(torch::randn({3, 8})).to(at::kFloat).sum().backward();
  const auto loss = model->forward(torch::randn({3, 8})).to(at::kFloat).sum();
  EXPECT_AMP_ERROR(scale_loss(loss, optimizer), "backward ran outside amp::scale_loss");
}

// --- Float32 inputs meeting low-precision parameter layers -------------------

struct LayerCase {
  std::string name;
  std::function<std::shared_ptr<torch::nn::Module>()> make;
  // Runs the layer on float32 data; returns a floating output.
  std::function<at::Tensor(torch::nn::Module&, const at::Tensor& x)> run;
};

template <class Holder>
LayerCase layer(std::string name, Holder holder) {
  return {std::move(name), [holder] { return holder.ptr()->clone(); },
          [](torch::nn::Module& m, const at::Tensor& x) {
            return dynamic_cast<typename Holder::ContainedType&>(m).forward(x);
          }};
}

template <class Holder>
LayerCase recurrent(std::string name, Holder holder) {
  return {std::move(name), [holder] { return holder.ptr()->clone(); },
          [](torch::nn::Module& m, const at::Tensor& x) {
            return std::get<0>(dynamic_cast<typename Holder::ContainedType&>(m).forward(x.view({3, 2, 6})));
          }};
}

std::vector<LayerCase> layer_cases() {
  using namespace torch::nn;
  return {
      layer("BatchNormAffine", BatchNorm1d(6)),
      layer("BatchNormNotAffine", BatchNorm1d(BatchNormOptions(6).affine(false))),
      {"InstanceNorm", [] { return InstanceNorm1d(InstanceNormOptions(2).affine(true).track_running_stats(true)).ptr()->clone(); },
       [](Module& m, const at::Tensor& x) { return dynamic_cast<InstanceNorm1dImpl&>(m).forward(x.view({3, 2, 6})); }},
      layer("GroupNorm", GroupNorm(2, 6)),
      layer("LayerNorm", LayerNorm(LayerNormOptions({6}))),
      recurrent("LSTM", LSTM(6, 4)),
      recurrent("GRU", GRU(6, 4)),
      recurrent("RNN", RNN(6, 4)),
      {"EmbeddingBagWeighted", [] { return EmbeddingBag(EmbeddingBagOptions(10, 6).mode(torch::kSum)).ptr()->clone(); },
       [](Module& m, const at::Tensor& x) {
         const auto indices = torch::tensor({1, 4, 4, 9, 0, 2}, torch::kLong);
         const auto offsets = torch::tensor({0, 3}, torch::kLong);
         return dynamic_cast<EmbeddingBagImpl&>(m).forward(indices, offsets, x.flatten().narrow(0, 0, 6).abs());
       }},
  };
}

class Fp32InputTest : public AmpTest, public ::testing::WithParamInterface<std::tuple<OptLevel, int>> {};

TEST_P(Fp32InputTest, LayerTrainsOnFloat32InputsAndMatchesFloat64) {
  const auto [level, index] = GetParam();
  const LayerCase c = layer_cases()[index];
  torch::manual_seed(index);
  auto module = c.make();
  module->train(index != 1);  // one BatchNorm in eval: its running statistics meet the input
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(module->parameters(), 0.01);
  Handle handle;
  handle.initialize({module}, {optimizer}, quiet(level));
  const auto x = torch::randn({6, 6});

  // Reference: the converted weights widened to float64, the input rounded
  // as amp rounds it, in plain LibTorch.
  auto reference = module->clone();
  reference->to(torch::kDouble);
  const at::ScalarType low = properties().low_precision_dtype(c10::kCPU);
  at::Tensor want;
  {
    disable_casts plain;
    want = c.run(*reference, x.to(low).to(torch::kDouble));
  }
  at::Tensor got = c.run(*module, x);
  EXPECT_TRUE(torch::allclose(got.to(torch::kDouble), want, 3e-2, 3e-2)) << "max |got - want| = "
      << (got.to(torch::kDouble) - want).abs().max().item<double>();
  if (module->parameters().empty()) return;  // nothing to train
  {
    scale_loss scaled(got.to(at::kFloat).square().mean(), optimizer);
    scaled.backward();
  }
  optimizer->step();
  for (const auto& p : master_params(*optimizer)) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
}

INSTANTIATE_TEST_SUITE_P(Layers, Fp32InputTest,
                         ::testing::Combine(::testing::Values(O2, O3, O5),
                                            ::testing::Range(0, static_cast<int>(layer_cases().size()))),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) + "_" +
                                  layer_cases()[std::get<1>(info.param)].name;
                         });

TEST_F(Fp32InputTest, BatchNormKeptFloat32AtO2IsLeftAsGiven) {
  torch::nn::BatchNorm1d bn(6);
  Handle handle;
  bn = handle.initialize(bn, quiet(O2));
  ASSERT_EQ(bn->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(bn(torch::randn({4, 6}).to(at::kBFloat16)).scalar_type(), at::kBFloat16);  // mixed, as native
  EXPECT_EQ(bn(torch::randn({4, 6})).scalar_type(), at::kFloat);
}

// --- One iteration ends: LibTorch's native autocast cache too ----------------

TEST_F(AmpTest, GuardEndClearsLibTorchsNativeAutocastCache) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O4));
  EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), at::kBFloat16);  // native kernels follow amp
  const auto& w = model->fc1->weight;
  const auto first = at::autocast::cached_cast(at::kBFloat16, w, c10::kCPU);
  EXPECT_TRUE(at::autocast::cached_cast(at::kBFloat16, w, c10::kCPU).is_same(first)) << "native cache in use";
  {
    scale_loss scaled(model->forward(torch::randn({2, 8})).to(at::kFloat).sum(), optimizer);
    scaled.backward();
  }
  EXPECT_FALSE(at::autocast::cached_cast(at::kBFloat16, w, c10::kCPU).is_same(first));
}

}  // namespace
}  // namespace amp::testing
