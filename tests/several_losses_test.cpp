// SPDX-License-Identifier: BSD-3-Clause
// Several models, losses and optimizers in the loops users write, checked by
// value against plain LibTorch in float64: Apex's L0 multi-model scenarios
// (zeroing through the model, the optimizer or not at all; one scaler or
// one per loss; inf in either loss) and a GAN whose generator loss runs
// through the discriminator.
#include "test_util.h"
#include <amp/internal/level_rules.h>

#include <limits>

namespace amp::testing {
namespace {


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

struct LossesCase {
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
std::vector<bool> discarded_at(const Scenario& s, const LossesCase& c, int iteration, size_t after_loss) {
  std::vector<bool> discard(s.optimizers.size(), false);
  if (c.inject_in_loss == static_cast<int>(after_loss) && iteration == kInjectAt) {
    for (int o : s.losses[after_loss].optimizers) discard[o] = true;
  }
  return discard;
}
std::vector<bool> skipped_at(const Scenario& s, const LossesCase& c, int iteration) {
  std::vector<bool> skip(s.optimizers.size(), false);
  for (size_t l = 0; l < s.losses.size(); ++l) {
    const auto discard = discarded_at(s, c, iteration, l);
    for (size_t o = 0; o < skip.size(); ++o) skip[o] = discard[o] || (skip[o] && !covers(s.losses[l], o));
  }
  return skip;
}

struct LossesTrace {
  std::vector<std::vector<std::vector<at::Tensor>>> grads;  // [iteration][optimizer][param]
  std::vector<at::Tensor> params;                           // final values, model order
};

// Plain LibTorch in float64: the same losses, zeroing as the user's loop
// does; gradients an overflow discards dropped, skipped steps not taken.
LossesTrace reference_run(const Scenario& s, const LossesCase& c) {
  std::vector<ApexModel> models;
  for (double u : s.u) models.emplace_back(u, torch::kDouble);
  auto optimizers = make_optimizers(s, models);
  LossesTrace trace;
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

class ApexScenarioTest : public AmpTest, public ::testing::WithParamInterface<LossesCase> {};

TEST_P(ApexScenarioTest, GradientsAndParametersEqualFloat64) {
  const LossesCase c = GetParam();
  const Scenario& s = scenarios()[c.scenario];
  const LossesTrace expected = reference_run(s, c);

  std::vector<ApexModel> models;
  std::vector<ModulePtr> modules;
  for (double u : s.u) {
    models.emplace_back(u, torch::kFloat);
    modules.push_back(models.back().ptr());
  }
  Options options = quiet(c.level);
  options.cpu_dtype = at::kHalf;  // every value here is exact in float16
  options.num_losses = c.separate_scalers ? 2 : 1;
  if (internal::resolve_properties(c.level, {}).loss_scale.dynamic) options.loss_scale = LossScale::Dynamic(4);
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

std::vector<LossesCase> apex_cases() {
  std::vector<LossesCase> out;
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
                         [](const ::testing::TestParamInfo<LossesCase>& info) {
                           const LossesCase& c = info.param;
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

}  // namespace
}  // namespace amp::testing
