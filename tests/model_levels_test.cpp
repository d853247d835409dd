// SPDX-License-Identifier: BSD-3-Clause
// initialize at O2/O3: model conversion, fp32 inputs, fp32 losses, master
// weights, saving and resuming, and initialize's own errors.
#include "test_util.h"

#include <cstdio>
#include <filesystem>

namespace amp::testing {
namespace {

// Conv, affine and non-affine BatchNorm, a custom fp32 norm, a linear head,
// and a tensor created inside forward (the classic Apex O2 failure).
struct ScaleNormImpl : torch::nn::Module {
  ScaleNormImpl() : gain(register_parameter("gain", torch::ones({8}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x / (x.to(at::kFloat).pow(2).mean(-1, true) + 1e-5).sqrt() * gain;
  }
  torch::Tensor gain;
};
TORCH_MODULE(ScaleNorm);

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(4))),
        plain_bn(register_module("plain_bn", torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(8).affine(false)))),
        norm(register_module("norm", ScaleNorm())),
        fc(register_module("fc", torch::nn::Linear(4 * 4 * 4, 8))),
        head(register_module("head", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn(conv(x)));
    h = torch::max_pool2d(h, 2).flatten(1);
    h = fc(h + torch::full({1}, 0.5));  // an fp32 tensor made inside forward
    return head(norm(plain_bn(h)));
  }
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
  torch::nn::BatchNorm1d plain_bn;
  ScaleNorm norm;
  torch::nn::Linear fc, head;
};
TORCH_MODULE(ConvNet);

Options o2_keep_norm_fp32(OptLevel level = O2) {
  Options options = level;
  options.verbosity = 0;
  options.keep_fp32 = [](const torch::nn::Module& m) {
    return dynamic_cast<const ScaleNormImpl*>(&m) != nullptr;
  };
  return options;
}

at::Tensor batch(int64_t seed) {
  torch::manual_seed(seed);
  return torch::randn({4, 1, 8, 8});
}
at::Tensor labels(int64_t seed) { return torch::arange(4) .add(seed).remainder(3); }

class ModelLevelsTest : public AmpTest {};

// O2 lowers every parameter and buffer for forward and backward except
// affine BatchNorm and kept modules; between iterations all of them hold
// their float32 values (the masters).
TEST_F(ModelLevelsTest, O2LowersAllButAffineBatchNormAndKeptModulesForForwardAndBackward) {
  ConvNet model;
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, o2_keep_norm_fp32());
  auto expect_dtypes = [&](at::ScalarType lowered) {
    EXPECT_EQ(model->conv->weight.scalar_type(), lowered);
    EXPECT_EQ(model->fc->bias.scalar_type(), lowered);
    EXPECT_EQ(model->head->weight.scalar_type(), lowered);
    EXPECT_EQ(model->plain_bn->running_var.scalar_type(), lowered);  // non-affine lowers
    EXPECT_EQ(model->bn->weight.scalar_type(), at::kFloat);
    EXPECT_EQ(model->bn->running_mean.scalar_type(), at::kFloat);
    EXPECT_EQ(model->bn->num_batches_tracked.scalar_type(), at::kLong);
    EXPECT_EQ(model->norm->gain.scalar_type(), at::kFloat);  // kept by keep_fp32
  };
  expect_dtypes(at::kFloat);  // at rest
  optimizer->zero_grad();
  const auto loss = torch::cross_entropy_loss(model->forward(batch(0)), labels(0));
  expect_dtypes(at::kBFloat16);  // forward ran in the low dtype
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();
    EXPECT_EQ(model->fc->weight.grad().scalar_type(), at::kBFloat16);  // backward's scratch
  }
  expect_dtypes(at::kFloat);  // at rest again, with float32 gradients
  for (const auto& p : model->parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
  for (const auto& p : master_params(*optimizer)) EXPECT_EQ(p.scalar_type(), at::kFloat);
}

TEST_F(ModelLevelsTest, O3ConvertsBatchNormUnlessKept) {
  for (bool keep : {false, true}) {
    ConvNet model;
    Options options = quiet(O3);
    options.cpu_dtype = at::kHalf;
    if (keep) options.keep_batchnorm_fp32 = true;
    Handle handle;
    handle.initialize(model, options);
    EXPECT_EQ(model->conv->weight.scalar_type(), at::kHalf);
    EXPECT_EQ(model->bn->weight.scalar_type(), keep ? at::kFloat : at::kHalf);
    EXPECT_EQ(properties().loss_scale.dynamic, false);
    EXPECT_EQ(loss_scale(), 1.0);
  }
}

TEST_F(ModelLevelsTest, Fp32InputsMeetALowPrecisionModelAndTheLossIsFp32) {
  for (OptLevel level : {O2, O3}) {
    ConvNet model;
    Handle handle;
    handle.initialize(model, o2_keep_norm_fp32(level));
    const auto out = model->forward(batch(0));  // fp32 input, unchanged user code
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    const auto loss = torch::cross_entropy_loss(out, labels(0));
    EXPECT_EQ(loss.scalar_type(), at::kFloat) << to_string(level);
    EXPECT_EQ(torch::log_softmax(out, 1).scalar_type(), at::kBFloat16);  // CPU table: no fp32 softmax
  }
}

TEST_F(ModelLevelsTest, KeptFp32ModulesComputeInFp32) {
  torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::Linear(4, 2));
  Options options = quiet(O2);
  auto head = model[1];
  options.keep_fp32 = [head](const torch::nn::Module& m) { return &m == head.get(); };
  Handle handle;
  handle.initialize(model, options);
  const auto h = model[0]->as<torch::nn::Linear>()->forward(torch::randn({3, 4}));
  EXPECT_EQ(h.scalar_type(), at::kBFloat16);
  EXPECT_EQ(model[1]->as<torch::nn::Linear>()->forward(h).scalar_type(), at::kFloat);
}

TEST_F(ModelLevelsTest, CastModelOutputsLowKeepsLossesInTheModelDtype) {
  ConvNet model;
  Options options = o2_keep_norm_fp32();
  options.cast_model_outputs = at::kBFloat16;
  Handle handle;
  handle.initialize(model, options);
  const auto out = model->forward(batch(0));
  EXPECT_EQ(torch::mse_loss(out, torch::zeros_like(out)).scalar_type(), at::kBFloat16);
}

// One O2 training step with fp32 data; returns nothing, checks invariants.
void train_step(ConvNet& model, OptimizerPtr& optimizer, int64_t seed, bool overflow = false) {
  optimizer->zero_grad();
  const auto loss = torch::cross_entropy_loss(model->forward(batch(seed)), labels(seed));
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();
    if (overflow) model->fc->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
  }
  optimizer->step();
}

// The optimizer steps the model's own parameters in float32; the next
// forward computes with their rounded values; the optimizer's state is
// float32 and keyed by the model's parameters, as without amp.
TEST_F(ModelLevelsTest, TheOptimizerStepsTheModelsFloat32ParametersAndForwardRoundsThem) {
  ConvNet model;
  const auto original = model->fc->weight.detach().clone();
  OptimizerPtr optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-2);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, o2_keep_norm_fp32());
  EXPECT_TRUE(BitEqual(model->fc->weight, original)) << "masters start from the exact float32 weights";
  for (int step = 0; step < 3; ++step) {
    train_step(model, optimizer, step);
    const auto master = model->fc->weight.detach().clone();
    EXPECT_EQ(master.scalar_type(), at::kFloat);
    (void)model->forward(batch(step));  // a graph-recording forward lowers the weights
    EXPECT_TRUE(BitEqual(model->fc->weight, master.to(at::kBFloat16))) << "step " << step;
  }
  EXPECT_FALSE(torch::equal(original, model->fc->weight.to(at::kFloat)));
  for (const auto& p : model->parameters()) {
    auto it = optimizer->state().find(p.unsafeGetTensorImpl());
    ASSERT_NE(it, optimizer->state().end());
    EXPECT_EQ(static_cast<const torch::optim::AdamParamState&>(*it->second).exp_avg().scalar_type(), at::kFloat);
  }
}

TEST_F(ModelLevelsTest, SkippedO2StepLeavesMastersModelAndStateBitIdentical) {
  ConvNet model;
  OptimizerPtr optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-2);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, o2_keep_norm_fp32());
  train_step(model, optimizer, 0);
  std::vector<at::Tensor> masters, params;
  for (const auto& m : master_params(*optimizer)) masters.push_back(m.detach().clone());
  for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
  std::stringstream state_before, state_after;
  torch::save(*optimizer, state_before);
  train_step(model, optimizer, 1, /*overflow=*/true);
  torch::save(*optimizer, state_after);
  EXPECT_EQ(state_before.str(), state_after.str());
  for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(BitEqual(master_params(*optimizer)[i], masters[i]));
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(BitEqual(model->parameters()[i], params[i]));
}

TEST_F(ModelLevelsTest, AddParamGroupAfterInitializeIsSteppedInFloat32) {
  ConvNet model;
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->conv->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, o2_keep_norm_fp32());
  std::vector<at::Tensor> rest;
  for (auto* m : {&model->fc, &model->head}) {
    for (const auto& p : (*m)->parameters()) rest.push_back(p);
  }
  optimizer->add_param_group(torch::optim::OptimizerParamGroup(rest));
  const auto head_before = model->head->weight.detach().clone();
  train_step(model, optimizer, 0);
  EXPECT_FALSE(torch::equal(head_before, model->head->weight));
  EXPECT_EQ(model->head->weight.grad().scalar_type(), at::kFloat);
  for (const auto& p : master_params(*optimizer)) EXPECT_EQ(p.scalar_type(), at::kFloat);
  EXPECT_EQ(master_params(*optimizer).size(), 2u + rest.size());
}

TEST_F(ModelLevelsTest, AcceptsSharedPtrAndModuleHolderModelsAndInference) {
  auto net = std::make_shared<TinyNetImpl>();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
  Handle handle;
  std::shared_ptr<TinyNetImpl> same;
  std::tie(same, optimizer) = handle.initialize(net, optimizer, quiet(O2));
  EXPECT_EQ(same, net);
  handle.deinitialize();
  TinyNet holder;
  TinyNet returned = handle.initialize(holder, quiet(O3));  // inference: no optimizer
  EXPECT_EQ(returned.ptr(), holder.ptr());
  EXPECT_EQ(holder->fc1->weight.scalar_type(), at::kBFloat16);
}

// Three steps of a random TinyNet at every level, SGD with momentum and Adam,
// against plain fp32 LibTorch: equal within the low dtype's tolerance (O0
// exactly), with the overflowed step skipped everywhere.
class ToleranceEquivalenceTest
    : public AmpTest,
      public ::testing::WithParamInterface<std::tuple<OptLevel, bool /*adam*/>> {};

TEST_P(ToleranceEquivalenceTest, ThreeStepsMatchFp32) {
  const auto [level, adam] = GetParam();
  auto make_optimizer = [adam = adam](std::vector<at::Tensor> params) -> OptimizerPtr {
    // eps 1e-3: Adam's normalization turns a bf16 rounding of a near-zero
    // gradient into a full +-lr step; a larger eps keeps such elements quiet,
    // so the comparison measures amp rather than Adam's sign sensitivity.
    if (adam) return std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).eps(1e-3));
    return std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(1e-2).momentum(0.9));
  };
  torch::manual_seed(3);
  TinyNet model, reference;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model->parameters().size(); ++i) reference->parameters()[i].copy_(model->parameters()[i]);
  }
  OptimizerPtr optimizer = make_optimizer(model->parameters());
  OptimizerPtr plain = make_optimizer(reference->parameters());
  Options options = quiet(level);
  options.loss_scale = LossScale::Dynamic();
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(100 + step);
    const auto x = torch::randn({16, 8}), y = torch::randn({16, 4});
    optimizer->zero_grad();
    {
      scale_loss scaled(torch::mse_loss(model->forward(x), y), optimizer);
      scaled.backward();
      if (step == 1) model->fc1->bias.grad()[0] = std::numeric_limits<float>::quiet_NaN();
    }
    optimizer->step();
    plain->zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    if (step != 1) plain->step();
  }
  for (size_t i = 0; i < reference->parameters().size(); ++i) {
    const auto ours = model->parameters()[i].to(at::kFloat), theirs = reference->parameters()[i];
    if (level == O0) {
      EXPECT_TRUE(BitEqual(ours, theirs)) << "parameter " << i;
    } else {
      EXPECT_TRUE(torch::allclose(ours, theirs, /*rtol=*/2e-2, /*atol=*/1e-2))
          << "parameter " << i << " max diff " << (ours - theirs).abs().max().item<double>();
    }
  }
  EXPECT_EQ(skipped_steps(*optimizer), 1);
}

INSTANTIATE_TEST_SUITE_P(Levels, ToleranceEquivalenceTest,
                         ::testing::Combine(::testing::Values(O0, O1, O2, O3), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_Adam" : "_SGDMomentum");
                         });

struct DataParallelWrapperImpl : torch::nn::Module {
  DataParallelWrapperImpl() { register_module("inner", TinyNet()); }
};
TORCH_MODULE(DataParallelWrapper);

TEST_F(ModelLevelsTest, InitializeErrorsChangeNothing) {
  Handle handle;
  auto mixed = std::make_shared<torch::nn::Module>();
  const auto on_cpu = mixed->register_parameter("on_cpu", torch::randn({2}));
  mixed->register_parameter("on_meta", torch::zeros({2}, torch::kMeta));
  EXPECT_AMP_ERROR(handle.initialize(mixed, quiet(O2)), "one device");
  EXPECT_EQ(on_cpu.scalar_type(), at::kFloat);  // not converted
  EXPECT_FALSE(is_initialized());

  EXPECT_AMP_ERROR(handle.initialize(DataParallelWrapper(), quiet(O1)), "wrap it for data parallelism afterwards");
  EXPECT_AMP_ERROR(handle.initialize(std::shared_ptr<TinyNetImpl>(), quiet(O1)), "null model");

  TinyNet model;
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Options bad = quiet(O1);
  bad.num_losses = 0;
  EXPECT_AMP_ERROR(handle.initialize(model, optimizer, bad), "num_losses must be >= 1");
  bad = quiet(O1);
  bad.verbosity = 3;
  EXPECT_AMP_ERROR(handle.initialize(model, optimizer, bad), "verbosity must be 0, 1 or 2");
  Options wrong = quiet(O1);
  wrong.master_weights = true;
  EXPECT_AMP_ERROR(handle.initialize(model, optimizer, wrong), "master_weights make no sense");
  EXPECT_FALSE(is_initialized());

  EXPECT_AMP_ERROR(handle.initialize({model}, {optimizer, optimizer}, quiet(O2)), "the same optimizer twice");
  EXPECT_EQ(model->fc1->weight.scalar_type(), at::kFloat);
  EXPECT_FALSE(is_initialized());
}

TEST_F(ModelLevelsTest, WarnsWhenTheModelIsAlreadyLowPrecision) {
  TinyNet model;
  model->to(at::kBFloat16);
  Handle handle;
  Options options = O2;
  LogRecorder log;
  handle.initialize(model, options);
  EXPECT_EQ(log.count(LogEvent::Kind::kWarning, "model_already_low_precision"), 1);
}

// Without masters an Adam-like optimizer works in the low dtype: an eps of 0
// there is NaN; in float16 squared gradients flush to zero besides (training
// diverges: examples/fashion_mnist at O3 in float16 reaches 10% accuracy);
// bfloat16 has float32's range.
TEST_F(ModelLevelsTest, WarnsWhenTheOptimizersStateVanishesWithoutMasterWeights) {
  enum class Opt { kAdam, kAdamEps1e4, kSgd };
  // The two warnings' counts after initialize.
  auto initialize_and_log = [](OptLevel level, Opt which, at::ScalarType dtype) {
    TinyNet model;
    OptimizerPtr optimizer;
    if (which == Opt::kSgd) optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
    if (which == Opt::kAdam) optimizer = std::make_shared<torch::optim::Adam>(model->parameters());
    if (which == Opt::kAdamEps1e4) {
      optimizer = std::make_shared<torch::optim::Adam>(model->parameters(),
                                                       torch::optim::AdamOptions().eps(1e-4));
    }
    Handle handle;
    Options options = level;
    options.cpu_dtype = dtype;
    LogRecorder log;
    handle.initialize(model, optimizer, options);
    return std::pair(log.count(LogEvent::Kind::kWarning, "optimizer_eps_vanishes"),
                     log.count(LogEvent::Kind::kWarning, "optimizer_moments_underflow"));
  };
  using Counts = std::pair<int, int>;
  EXPECT_EQ(initialize_and_log(O3, Opt::kAdam, at::kHalf), Counts(1, 0)) << "NaN says it all";
  EXPECT_EQ(initialize_and_log(O3, Opt::kAdamEps1e4, at::kHalf), Counts(0, 1));
  EXPECT_EQ(initialize_and_log(O2, Opt::kAdam, at::kHalf), Counts(0, 0)) << "masters update in float32";
  EXPECT_EQ(initialize_and_log(O3, Opt::kSgd, at::kHalf), Counts(0, 0));
  EXPECT_EQ(initialize_and_log(O3, Opt::kAdam, at::kBFloat16), Counts(0, 0)) << "bfloat16 has float32's range";
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

// Four 512x512 layers: 1 MiB of float32 gradient each, so the guard's
// unscale runs in several slices.
torch::nn::Sequential wide_stack() {
  torch::manual_seed(0);
  torch::nn::Sequential stack;
  for (int i = 0; i < 4; ++i) stack->push_back(torch::nn::Linear(512, 512));
  return stack;
}

int64_t parameter_count(torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.numel();
  return n;
}

// Masters hold no low-precision copies between iterations, and a step
// never holds the copies or the scratch gradients beside the float32
// gradients: above the masters, backward holds copies and scratch
// gradients (2 + 2 bytes a parameter), the unscale the float32 gradients
// and an eighth of the scratch ones (4 + 2/8), never 2 + 2 + 4.
TEST_F(ModelLevelsTest, MastersNeverHoldCopiesOrScratchGradientsBesideFloat32Gradients) {
  amp::track_allocations();
  for (const OptLevel level : {O2, O5}) {
    SCOPED_TRACE(to_string(level));
    torch::nn::Sequential model = wide_stack();
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    Handle handle;
    handle.initialize(model, optimizer, quiet(level));
    const int64_t n = parameter_count(*model);
    const at::Tensor x = torch::randn({4, 512});
    for (int step = 0; step < 2; ++step) {
      optimizer.zero_grad();
      reset_peak_allocated();
      const int64_t start = allocated_bytes().current;
      {
        scale_loss scaled(model->forward(x).to(at::kFloat).pow(2).mean(), optimizer);
        scaled.backward();
        scaled.unscale();
        // At rest from the unscale on: float32 weights and gradients.
        EXPECT_EQ(model[0]->as<torch::nn::Linear>()->weight.scalar_type(), at::kFloat);
        EXPECT_EQ(model[0]->as<torch::nn::Linear>()->weight.grad().scalar_type(), at::kFloat);
      }
      const int64_t activations = 256 << 10;  // a 4-row batch's, generously
      EXPECT_LE(allocated_bytes().peak - start, n * 4 + n * 2 / 8 + activations);
      EXPECT_GE(allocated_bytes().peak - start, n * 4);
      EXPECT_EQ(training_bytes(optimizer).weights, 0) << "no low-precision copies between iterations";
      EXPECT_EQ(allocated_bytes().current - start, n * 4) << "the float32 gradients alone";
      optimizer.step();
    }
  }
}

// The unscale's slices share one inf/NaN flag: a non-finite gradient in
// the first slice or the last skips the whole step.
TEST_F(ModelLevelsTest, ANonFiniteGradientInAnyUnscaleSliceSkipsTheStep) {
  for (const int layer : {0, 3}) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    torch::nn::Sequential model = wide_stack();
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    Handle handle;
    handle.initialize(model, optimizer, quiet(O2));
    const auto before = clones(model->parameters());
    const double scale = loss_scale();
    optimizer.zero_grad();
    {
      scale_loss scaled(model->forward(torch::randn({4, 512})).to(at::kFloat).pow(2).mean(), optimizer);
      scaled.backward();
      model[layer]->as<torch::nn::Linear>()->weight.grad()[7][5].fill_(std::numeric_limits<float>::infinity());
    }
    optimizer.step();
    EXPECT_TRUE(last_step_skipped(optimizer));
    EXPECT_EQ(loss_scale(), scale / 2);
    const auto after = model->parameters();
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(BitEqual(after[i], before[i])) << i;
  }
}

}  // namespace
}  // namespace amp::testing
