// SPDX-License-Identifier: BSD-3-Clause
// Adopting amp in LibTorch programs written the way LibTorch teaches: the
// module and the optimizer held by value (LibTorch's MNIST example), holders
// and shared pointers, functions taking torch::optim::Optimizer&, the
// program's own zero_grad, schedulers and torch::save / torch::load. Each
// program gets Apex's edits only - the include, amp::initialize, a guard
// around backward - and is compared with a reference computed another way:
// the same program without amp (O0), with LibTorch's native autocast and a
// hand-written loss scale (O1, O4), or a hand-written Apex O2/O3 with native
// autocast on a converted copy (O2, O3, O5). The arithmetic is the same, so
// parameters are compared bit for bit.
#include "test_util.h"

#include <cstdio>

#include <ATen/autocast_mode.h>

#include <functional>

namespace amp::testing {
namespace {

// LibTorch's MNIST example's shape of model: a plain torch::nn::Module
// subclass, used by value. `gain` is read by an elementwise op, which no
// cast list names: at O2 it computes in the model's low dtype, at O1 in
// float32, so the comparisons tell the levels apart.
struct Net : torch::nn::Module {
  Net()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(4))),
        fc1(register_module("fc1", torch::nn::Linear(4 * 4 * 4, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 3))),
        gain(register_parameter("gain", torch::full({4, 1, 1}, 1.5))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn(conv(x) * gain)), 2).flatten(1);
    return torch::log_softmax(fc2(torch::relu(fc1(x))), 1);
  }
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
  torch::nn::Linear fc1, fc2;
  torch::Tensor gain;
};
TORCH_MODULE_IMPL(NetHolder, Net);

struct Batch {
  torch::Tensor data, target;
};
Batch batch(int step) {
  torch::manual_seed(1000 + step);
  return {torch::randn({8, 1, 8, 8}), torch::randint(0, 3, {8})};
}

constexpr int kLoopSteps = 4;
using amp::initialize;

Options quiet_level(OptLevel level) {
  Options options = level;
  options.verbosity = 0;
  return options;
}

std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

// ---- References: the same training, mixed precision written by hand -------

// What amp's level means for the reference: the model's compute dtype
// (nullopt: float32 weights with per-op autocast), master weights, and the
// loss scale (amp's initial dynamic scale, exact in every step here).
struct HandWritten {
  std::optional<at::ScalarType> model_dtype;
  bool keep_batchnorm_fp32 = false;
  bool masters = false;
  double scale = 1.0;
  bool autocast = true;
};
HandWritten hand_written(OptLevel level) {
  switch (level) {
    case O0: return {std::nullopt, false, false, 1.0, /*autocast=*/false};
    case O1: return {std::nullopt, false, false, 65536.0};
    case O2: return {at::kBFloat16, true, true, 65536.0};
    case O3: return {at::kBFloat16, false, false, 1.0};
    case O4: return {std::nullopt, false, false, 1.0};
    case O5: return {at::kBFloat16, true, true, 1.0};
  }
  return {};
}

// One model and its optimizer under mixed precision written by hand, as
// amp's `level` means it: native autocast (bf16 on the CPU), a static loss
// scale with gradients set aside, unscaled and added back as a guard does,
// and at O2/O3/O5 a converted model with float32 masters stepped in place
// of its parameters.
class ByHand {
 public:
  ByHand(torch::nn::Module& model, torch::optim::Optimizer& optimizer, OptLevel level)
      : h_(hand_written(level)), optimizer_(optimizer) {
    if (!h_.model_dtype) return;
    std::vector<at::Tensor> params = model.parameters(), before = snapshot(params);
    convert_model(model, *h_.model_dtype, h_.keep_batchnorm_fp32);
    for (size_t i = 0; h_.masters && i < params.size(); ++i) {
      if (params[i].scalar_type() != *h_.model_dtype) continue;
      at::Tensor master = before[i].requires_grad_(true);
      lowered_.emplace_back(params[i], master);
      for (auto& group : optimizer.param_groups()) {
        for (auto& p : group.params()) {
          if (p.is_same(params[i])) p = master;
        }
      }
      auto& state = optimizer.state();
      if (auto it = state.find(params[i].unsafeGetTensorImpl()); it != state.end()) {
        auto moved = std::move(it->second);
        state.erase(it);
        state[master.unsafeGetTensorImpl()] = std::move(moved);
      }
    }
  }
  double scale() const { return h_.scale; }

  // Before forward: the compute copy takes the masters' values.
  void refresh() {
    torch::NoGradGuard no_grad;
    for (auto& [compute, master] : lowered_) compute.copy_(master);
  }
  // Runs `f` under native autocast, as amp's casts would.
  template <class F>
  torch::Tensor forward(F&& f) {
    const bool was = at::autocast::is_autocast_enabled(at::kCPU);
    at::autocast::set_autocast_enabled(at::kCPU, h_.autocast);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    torch::Tensor out = f();
    at::autocast::set_autocast_enabled(at::kCPU, was);
    at::autocast::clear_cache();
    return out;
  }
  // Before a backward for this optimizer: gradients set aside.
  void set_aside() {
    aside_.clear();
    for (auto& p : stepped()) aside_.push_back(std::exchange(p.mutable_grad(), at::Tensor()));
    for (auto& [compute, master] : lowered_) compute.mutable_grad() = at::Tensor();
  }
  // After it: float32 gradients, unscaled, plus what was set aside.
  void unscale() {
    torch::NoGradGuard no_grad;
    for (auto& [compute, master] : lowered_) {
      if (compute.grad().defined()) master.mutable_grad() = compute.grad().to(at::kFloat);
    }
    std::vector<at::Tensor> params = stepped();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& grad = params[i].mutable_grad();
      if (grad.defined() && h_.scale != 1.0) grad.mul_(1.0 / h_.scale);
      if (aside_[i].defined()) grad = grad.defined() ? grad.add_(aside_[i]) : aside_[i];
    }
  }
  // The model's parameters hold the masters again, for comparing.
  void finish() {
    torch::NoGradGuard no_grad;
    for (auto& [compute, master] : lowered_) compute.set_data(master.detach());
  }

 private:
  std::vector<at::Tensor> stepped() {
    std::vector<at::Tensor> out;
    for (const auto& group : optimizer_.param_groups()) out.insert(out.end(), group.params().begin(), group.params().end());
    return out;
  }

  HandWritten h_;
  torch::optim::Optimizer& optimizer_;
  std::vector<std::pair<at::Tensor, at::Tensor>> lowered_;  // (compute, master)
  std::vector<at::Tensor> aside_;
};

// How the program clears gradients.
enum class ZeroGrad { kOptimizerFirst, kModelFirst, kOptimizerAfterForward, kNever };

struct Loop {
  int first_step = 0;
  int steps = kLoopSteps;
  ZeroGrad zero_grad = ZeroGrad::kOptimizerFirst;
  std::function<void()> after_step = [] {};  // LR schedulers
};

// The loops of the tests below, written by hand (ByHand).
template <class Model>
void train_by_hand(Model& model, torch::optim::Optimizer& optimizer, OptLevel level,
                   const std::function<torch::Tensor(Model&, const Batch&)>& loss_of,
                   const Loop& loop = {}) {
  ByHand hand(model, optimizer, level);
  for (int step = loop.first_step; step < loop.first_step + loop.steps; ++step) {
    hand.refresh();
    if (loop.zero_grad == ZeroGrad::kOptimizerFirst || loop.zero_grad == ZeroGrad::kModelFirst) {
      optimizer.zero_grad();
    }
    const torch::Tensor loss = hand.forward([&] { return loss_of(model, batch(step)); });
    if (loop.zero_grad == ZeroGrad::kOptimizerAfterForward) optimizer.zero_grad();
    hand.set_aside();
    (loss.to(at::kFloat) * hand.scale()).backward();
    hand.unscale();
    optimizer.step();
    loop.after_step();
  }
  hand.finish();
}

torch::Tensor nll(Net& m, const Batch& b) { return torch::nll_loss(m.forward(b.data), b.target); }

class AdoptionTest : public AmpTest, public ::testing::WithParamInterface<OptLevel> {};

// LibTorch's MNIST example, adopted: `Net model;` and an optimizer by value,
// a train function taking torch::optim::Optimizer&.
void train_epoch(Net& model, torch::optim::Optimizer& optimizer, int steps) {
  model.train();
  for (int step = 0; step < steps; ++step) {
    const Batch b = batch(step);
    optimizer.zero_grad();
    auto loss = torch::nll_loss(model.forward(b.data), b.target);
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
}

TEST_P(AdoptionTest, ModelAndOptimizerByValueAsInLibTorchsMnistExample) {
  const OptLevel level = GetParam();
  torch::manual_seed(0);
  Net model;
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::initialize(model, optimizer, quiet_level(level));
  train_epoch(model, optimizer, kLoopSteps);
  EXPECT_EQ(amp::skipped_steps(optimizer), 0);
  amp::deinitialize();

  torch::manual_seed(0);
  Net reference;
  torch::optim::SGD reference_optimizer(reference.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  train_by_hand<Net>(reference, reference_optimizer, level, nll);
  EXPECT_TRUE(AllBitEqual(model.parameters(), reference.parameters()));
  EXPECT_TRUE(AllBitEqual(model.buffers(), reference.buffers()));
  EXPECT_TRUE(AllBitEqual(optimizer_state_tensors(optimizer), optimizer_state_tensors(reference_optimizer)));
}

// A TORCH_MODULE holder, a std::shared_ptr to the concrete optimizer class,
// and Adam (per-parameter state) instead of SGD.
TEST_P(AdoptionTest, HolderAndSharedPtrToTheConcreteOptimizer) {
  const OptLevel level = GetParam();
  torch::manual_seed(0);
  NetHolder model;
  auto optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
  initialize(model, optimizer, quiet_level(level));
  for (int step = 0; step < kLoopSteps; ++step) {
    const Batch b = batch(step);
    optimizer->zero_grad();
    auto loss = torch::nll_loss(model->forward(b.data), b.target);
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer->step();
  }
  deinitialize();

  torch::manual_seed(0);
  Net reference;
  torch::optim::Adam reference_optimizer(reference.parameters(), torch::optim::AdamOptions(1e-2));
  train_by_hand<Net>(reference, reference_optimizer, level, nll);
  EXPECT_TRUE(AllBitEqual(model->parameters(), reference.parameters()));
  EXPECT_TRUE(AllBitEqual(optimizer_state_tensors(*optimizer), optimizer_state_tensors(reference_optimizer)));
}

// The four ways programs clear gradients - the optimizer's or the model's
// zero_grad before forward, the optimizer's after forward (O2's weights are
// in the low dtype then), or never (gradients accumulate across steps, as in
// float32) - train as the hand-written program does.
TEST_P(AdoptionTest, ZeroGradEitherWayOrNever) {
  const OptLevel level = GetParam();
  for (ZeroGrad mode : {ZeroGrad::kOptimizerFirst, ZeroGrad::kModelFirst, ZeroGrad::kOptimizerAfterForward,
                        ZeroGrad::kNever}) {
    torch::manual_seed(0);
    Net model;
    torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.02));
    {
      Handle handle;
      handle.initialize(model, optimizer, quiet_level(level));
      for (int step = 0; step < kLoopSteps; ++step) {
        const Batch b = batch(step);
        if (mode == ZeroGrad::kOptimizerFirst) optimizer.zero_grad();
        if (mode == ZeroGrad::kModelFirst) model.zero_grad();
        auto loss = nll(model, b);
        if (mode == ZeroGrad::kOptimizerAfterForward) optimizer.zero_grad();
        {
          amp::scale_loss scaled(loss, optimizer);
          scaled.backward();
        }
        optimizer.step();
      }
    }
    torch::manual_seed(0);
    Net reference;
    torch::optim::SGD reference_optimizer(reference.parameters(), torch::optim::SGDOptions(0.02));
    Loop loop;
    loop.zero_grad = mode;
    train_by_hand<Net>(reference, reference_optimizer, level, nll, loop);
    EXPECT_TRUE(AllBitEqual(model.parameters(), reference.parameters())) << "zero_grad mode " << int(mode);
  }
}

// An LR scheduler made on the program's optimizer, before initialize, as
// existing code has it; amp never replaces the optimizer it steps.
TEST_P(AdoptionTest, SchedulerMadeBeforeInitialize) {
  const OptLevel level = GetParam();
  torch::manual_seed(0);
  Net model;
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::StepLR scheduler(optimizer, /*step_size=*/1, /*gamma=*/0.5);
  initialize(model, optimizer, quiet_level(level));
  for (int step = 0; step < kLoopSteps; ++step) {
    optimizer.zero_grad();
    auto loss = nll(model, batch(step));
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    if (!amp::last_step_skipped(optimizer)) scheduler.step();
  }
  deinitialize();

  torch::manual_seed(0);
  Net reference;
  torch::optim::SGD reference_optimizer(reference.parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::StepLR reference_scheduler(reference_optimizer, 1, 0.5);
  Loop loop;
  loop.after_step = [&] { reference_scheduler.step(); };
  train_by_hand<Net>(reference, reference_optimizer, level, nll, loop);
  EXPECT_TRUE(AllBitEqual(model.parameters(), reference.parameters()));
  EXPECT_LT(optimizer.param_groups()[0].options().get_lr(), 0.05);
  EXPECT_EQ(optimizer.param_groups()[0].options().get_lr(),
            reference_optimizer.param_groups()[0].options().get_lr());
}

// A DCGAN-shaped program: two models held by TORCH_MODULE holders, two
// optimizers by value, three losses with their own scalers, and the
// generator's loss backpropagated through the discriminator.
struct GeneratorImpl : torch::nn::Module {
  GeneratorImpl()
      : fc1(register_module("fc1", torch::nn::Linear(4, 16))),
        bn(register_module("bn", torch::nn::BatchNorm1d(16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 8))) {}
  torch::Tensor forward(const torch::Tensor& z) { return torch::tanh(fc2(torch::relu(bn(fc1(z))))); }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Generator);

struct DiscriminatorImpl : torch::nn::Module {
  DiscriminatorImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))), fc2(register_module("fc2", torch::nn::Linear(16, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::leaky_relu(fc1(x), 0.2)).squeeze(1); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Discriminator);

struct GanBatch {
  torch::Tensor real, noise;
};
GanBatch gan_batch(int step) {
  torch::manual_seed(500 + step);
  return {torch::rand({16, 8}) * 2 - 1, torch::randn({16, 4})};
}
torch::Tensor bce(const torch::Tensor& logits, double target) {
  return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, target));
}

TEST_P(AdoptionTest, GanWithTheGeneratorLossThroughTheDiscriminator) {
  const OptLevel level = GetParam();
  const auto adam = torch::optim::AdamOptions(1e-3).betas({0.5, 0.999});
  torch::manual_seed(0);
  Generator generator;
  Discriminator discriminator;
  torch::optim::Adam opt_g(generator->parameters(), adam);
  torch::optim::Adam opt_d(discriminator->parameters(), adam);
  Options options = quiet_level(level);
  options.num_losses = 3;
  {
    Handle handle;
    handle.initialize({generator, discriminator}, {opt_g, opt_d}, options);
    for (int step = 0; step < kLoopSteps; ++step) {
      const GanBatch b = gan_batch(step);
      const auto fake = generator->forward(b.noise);
      opt_d.zero_grad();
      const auto err_real = bce(discriminator->forward(b.real), 1);
      {
        amp::scale_loss scaled(err_real, opt_d, {/*loss_id=*/0});
        scaled.backward();
      }
      const auto err_fake = bce(discriminator->forward(fake.detach()), 0);
      {
        amp::scale_loss scaled(err_fake, opt_d, {/*loss_id=*/1});
        scaled.backward();
      }
      opt_d.step();
      opt_g.zero_grad();
      const auto err_g = bce(discriminator->forward(fake), 1);
      {
        amp::scale_loss scaled(err_g, opt_g, {/*loss_id=*/2});
        scaled.backward();
      }
      opt_g.step();
    }
  }

  torch::manual_seed(0);
  Generator ref_g;
  Discriminator ref_d;
  torch::optim::Adam ref_opt_g(ref_g->parameters(), adam);
  torch::optim::Adam ref_opt_d(ref_d->parameters(), adam);
  ByHand hand_g(*ref_g, ref_opt_g, level), hand_d(*ref_d, ref_opt_d, level);
  auto backward = [](ByHand& hand, const torch::Tensor& loss) {
    hand.set_aside();
    (loss * hand.scale()).backward();
    hand.unscale();
  };
  for (int step = 0; step < kLoopSteps; ++step) {
    const GanBatch b = gan_batch(step);
    hand_g.refresh();
    hand_d.refresh();
    const auto fake = hand_g.forward([&] { return ref_g->forward(b.noise); });
    ref_opt_d.zero_grad();
    backward(hand_d, hand_d.forward([&] { return bce(ref_d->forward(b.real), 1); }));
    backward(hand_d, hand_d.forward([&] { return bce(ref_d->forward(fake.detach()), 0); }));
    ref_opt_d.step();
    hand_d.refresh();
    ref_opt_g.zero_grad();
    backward(hand_g, hand_d.forward([&] { return bce(ref_d->forward(fake), 1); }));
    ref_opt_g.step();
  }
  hand_g.finish();
  hand_d.finish();
  EXPECT_TRUE(AllBitEqual(generator->parameters(), ref_g->parameters()));
  EXPECT_TRUE(AllBitEqual(generator->buffers(), ref_g->buffers()));
  EXPECT_TRUE(AllBitEqual(discriminator->parameters(), ref_d->parameters()));
}

// ---- The program's own torch::save / torch::load -------------------------

struct Saved {
  std::string model, optimizer;
};

// The program's plain training loop; with amp live, its guard.
void train_holder(NetHolder& model, torch::optim::Optimizer& optimizer, int first, int steps) {
  for (int step = first; step < first + steps; ++step) {
    optimizer.zero_grad();
    auto loss = nll(*model, batch(step));
    if (is_initialized()) {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    } else {
      loss.backward();
    }
    optimizer.step();
  }
}

Saved save(NetHolder& model, torch::optim::Optimizer& optimizer) {
  std::ostringstream m, o;
  torch::save(model, m);
  torch::save(optimizer, o);
  return {m.str(), o.str()};
}

void load(NetHolder& model, torch::optim::Optimizer& optimizer, const Saved& saved) {
  std::istringstream m(saved.model), o(saved.optimizer);
  torch::load(model, m);
  torch::load(optimizer, o);
}

// Loads a checkpoint into a float32 model by hand: a 16-bit one (written at
// O3) through a model of its dtype, widened exactly afterwards.
void load_fp32_by_hand(NetHolder& model, torch::optim::Optimizer& optimizer, const Saved& saved) {
  torch::serialize::InputArchive archive;
  std::istringstream m(saved.model);
  archive.load_from(m);
  at::Tensor probe;
  archive.read("gain", probe);
  if (probe.scalar_type() != at::kFloat) convert_model(*model, probe.scalar_type(), false);
  load(model, optimizer, saved);
  torch::NoGradGuard no_grad;
  for (auto& t : model->parameters()) t.set_data(t.detach().to(at::kFloat));
  for (auto& t : model->buffers()) {
    if (t.is_floating_point()) t.set_data(t.detach().to(at::kFloat));
  }
}

// A checkpoint the program wrote before it adopted amp, loaded after
// amp::initialize (the usual order: set-up, then restore) or before it:
// training goes on from the checkpoint's values at every level.
TEST_P(AdoptionTest, Fp32CheckpointFromBeforeAmpLoadsInEitherOrder) {
  const OptLevel level = GetParam();
  torch::manual_seed(0);
  NetHolder before_amp;
  torch::optim::SGD before_optimizer(before_amp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  train_holder(before_amp, before_optimizer, 0, 2);
  const Saved saved = save(before_amp, before_optimizer);

  torch::manual_seed(1);
  NetHolder reference;
  torch::optim::SGD reference_optimizer(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  load(reference, reference_optimizer, saved);
  Loop loop;
  loop.first_step = 2;
  train_by_hand<Net>(*reference, reference_optimizer, level, nll, loop);

  for (bool load_first : {false, true}) {
    torch::manual_seed(1);  // other initial weights: the load must replace them
    NetHolder model;
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    if (load_first) load(model, optimizer, saved);
    initialize(model, optimizer, quiet_level(level));
    if (!load_first) load(model, optimizer, saved);
    train_holder(model, optimizer, 2, kLoopSteps);
    deinitialize();
    EXPECT_TRUE(AllBitEqual(model->parameters(), reference->parameters())) << "load first: " << load_first;
    EXPECT_TRUE(AllBitEqual(model->buffers(), reference->buffers())) << "load first: " << load_first;
  }
}

// A checkpoint written by the program at one level, restored at another:
// the values it holds are what the next level trains from (O3's bfloat16
// weights widened exactly). O0 changes nothing, so there LibTorch refuses a
// 16-bit checkpoint in a float32 model, as without amp.
TEST_P(AdoptionTest, CheckpointWrittenAtAnotherLevel) {
  const OptLevel level = GetParam();
  for (OptLevel written_at : {O1, O2, O3, O5}) {
    torch::manual_seed(0);
    NetHolder first;
    torch::optim::SGD first_optimizer(first->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    Saved saved;
    {
      Handle handle;
      handle.initialize(first, first_optimizer, quiet_level(written_at));
      train_holder(first, first_optimizer, 0, 2);
      saved = save(first, first_optimizer);
    }
    if (level == O0 && written_at == O3) {
      NetHolder fp32;
      torch::optim::SGD fp32_optimizer(fp32->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      Handle handle;
      handle.initialize(fp32, fp32_optimizer, quiet_level(level));
      EXPECT_THROW(load(fp32, fp32_optimizer, saved), c10::Error);
      continue;
    }
    torch::manual_seed(1);
    NetHolder reference;
    torch::optim::SGD reference_optimizer(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    load_fp32_by_hand(reference, reference_optimizer, saved);
    Loop loop;
    loop.first_step = 2;
    train_by_hand<Net>(*reference, reference_optimizer, level, nll, loop);

    torch::manual_seed(1);
    NetHolder model;
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    initialize(model, optimizer, quiet_level(level));
    load(model, optimizer, saved);
    train_holder(model, optimizer, 2, kLoopSteps);
    deinitialize();
    EXPECT_TRUE(AllBitEqual(model->parameters(), reference->parameters())) << "written at " << to_string(written_at);
  }
}

// A parameter group added after amp::initialize (a head trained first, the
// rest unfrozen later) trains as one added before it: every guard reads the
// optimizer's groups as they are.
TEST_P(AdoptionTest, ParamGroupAddedAfterInitializeTrainsAsOneAddedBefore) {
  auto train = [&](bool add_before) {
    torch::manual_seed(0);
    NetHolder model;
    torch::optim::SGD optimizer(model->fc2->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<at::Tensor> rest;
    for (const auto& item : model->named_parameters()) {
      if (item.key().rfind("fc2.", 0) != 0) rest.push_back(item.value());
    }
    if (add_before) optimizer.add_param_group(rest);
    initialize(model, optimizer, quiet_level(GetParam()));
    if (!add_before) optimizer.add_param_group(rest);
    train_holder(model, optimizer, 0, kLoopSteps);
    deinitialize();
    return snapshot(model->parameters());
  };
  const auto before = train(true), after = train(false);
  EXPECT_TRUE(AllBitEqual(after, before));
  torch::manual_seed(0);
  NetHolder untrained;
  const auto keys = untrained->named_parameters().keys();
  const size_t conv = std::find(keys.begin(), keys.end(), "conv.weight") - keys.begin();
  ASSERT_LT(conv, keys.size());
  EXPECT_FALSE(BitEqual(after[conv], untrained->conv->weight.to(after[conv].scalar_type())));  // the added group trained
}

INSTANTIATE_TEST_SUITE_P(Levels, AdoptionTest, ::testing::Values(O0, O1, O2, O3, O4, O5),
                         [](const auto& info) { return std::string(to_string(info.param)); });

class AdoptionShapesTest : public AmpTest {};

// The other ways programs hold things: a std::shared_ptr<Optimizer> that
// code written for amp's earlier form re-assigns from initialize's result,
// nn::Sequential with the optimizer passed by reference, several models of
// different holders in braces, and the level as Apex's string.
TEST_F(AdoptionShapesTest, SharedPointersSequentialListsAndStringLevels) {
  {
    auto model = std::make_shared<Net>();
    std::shared_ptr<torch::optim::Optimizer> optimizer =
        std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
    const auto* same_model = model.get();
    const auto* same_optimizer = optimizer.get();
    std::tie(model, optimizer) = initialize(model, optimizer, quiet_level(O2));
    EXPECT_EQ(model.get(), same_model);
    EXPECT_EQ(optimizer.get(), same_optimizer);
    deinitialize();
  }
  {
    NetHolder model;
    auto adam = std::make_shared<torch::optim::Adam>(model->parameters());  // the concrete class
    std::tie(model, adam) = initialize(model, adam, O1);
    EXPECT_EQ(properties().opt_level, O1);
    deinitialize();
  }
  {
    torch::nn::Sequential model(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
    torch::optim::Adam adam(model->parameters());
    torch::optim::Optimizer& optimizer = adam;
    initialize(model, optimizer, "O2");
    EXPECT_EQ(properties().opt_level, O2);
    auto loss = model->forward(torch::randn({3, 4})).sum();
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    EXPECT_EQ(model[0]->as<torch::nn::Linear>()->weight.grad().scalar_type(), at::kFloat);
    deinitialize();
  }
  {
    NetHolder encoder;
    Net decoder;
    torch::optim::SGD optimizer(encoder->parameters(), 0.1);
    optimizer.add_param_group(decoder.parameters());
    initialize({encoder, decoder}, {optimizer}, std::string("O5"));
    EXPECT_EQ(properties().opt_level, O5);
    EXPECT_EQ(loss_scale(), 1.0);
    deinitialize();
  }
}

// deinitialize leaves O2's models in float32 and the optimizers as they
// were, so the same objects initialize again (at any level).
TEST_F(AdoptionShapesTest, DeinitializeLeavesFloat32ObjectsThatInitializeAgain) {
  torch::manual_seed(0);
  Net model;
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (OptLevel level : {O2, O5, O1, O2}) {
    initialize(model, optimizer, quiet_level(level));
    train_epoch(model, optimizer, 2);
    deinitialize();
    for (const auto& p : model.parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat) << to_string(level);
    for (const auto& p : model.parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat) << to_string(level);
  }
}

// A forward that records a graph without a guard after it (validation
// without NoGradGuard) leaves O2's weights in the low dtype; a torch::load
// then still takes the checkpoint's values, and the next guard's step trains
// from them.
TEST_F(AdoptionShapesTest, LoadAfterAForwardWithoutGuardTakesTheCheckpoint) {
  torch::manual_seed(0);
  NetHolder source;
  torch::optim::SGD source_optimizer(source->parameters(), 0.05);
  const Saved saved = save(source, source_optimizer);

  torch::manual_seed(1);
  NetHolder model;
  torch::optim::SGD optimizer(model->parameters(), 0.05);
  initialize(model, optimizer, quiet_level(O2));
  (void)nll(*model, batch(0));  // graph recorded, never backpropagated
  EXPECT_EQ(model->fc1->weight.scalar_type(), at::kBFloat16);
  load(model, optimizer, saved);
  train_holder(model, optimizer, 2, 2);
  deinitialize();

  torch::manual_seed(1);
  NetHolder reference;
  torch::optim::SGD reference_optimizer(reference->parameters(), 0.05);
  load(reference, reference_optimizer, saved);
  Loop loop;
  loop.first_step = 2;
  loop.steps = 2;
  train_by_hand<Net>(*reference, reference_optimizer, O2, nll, loop);
  EXPECT_TRUE(AllBitEqual(model->parameters(), reference->parameters()));
}

// amp::save_fp32_weights at O3 (a model lowered for good): a float32 copy
// for inference without amp, the weights widened exactly.
TEST_F(AdoptionShapesTest, Fp32WeightsExportLoadsIntoAPlainModel) {
  NetHolder model;
  torch::optim::SGD optimizer(model->parameters(), 0.05);
  initialize(model, optimizer, quiet_level(O3));
  train_holder(model, optimizer, 0, 2);
  const std::string path = temp_path("fp32_weights.pt");
  save_fp32_weights(model, path);
  deinitialize();
  NetHolder plain;
  torch::load(plain, path);
  for (size_t i = 0; i < plain->parameters().size(); ++i) {
    EXPECT_TRUE(BitEqual(plain->parameters()[i], model->parameters()[i].to(at::kFloat)));
  }
  std::remove(path.c_str());
}

// ---- Misuse that used to train wrongly without a word ----------------------

class AdoptionMisuseTest : public AmpTest {};

// Backward outside the guard at O2 gives the low-precision weights
// gradients and the optimizer steps them; the next guard says so.
TEST_F(AdoptionMisuseTest, BackwardOutsideTheGuardAtO2IsCaughtAtTheNextGuard) {
  Net model;
  torch::optim::SGD optimizer(model.parameters(), 0.05);
  initialize(model, optimizer, quiet_level(O2));
  optimizer.zero_grad();
  nll(model, batch(0)).backward();
  optimizer.step();
  auto loss = nll(model, batch(1));
  EXPECT_AMP_ERROR(amp::scale_loss(loss, optimizer), "a backward ran outside amp::scale_loss");
}

TEST_F(AdoptionMisuseTest, AnOptimizerNotPassedToInitializeIsRefused) {
  Net model;
  torch::optim::SGD optimizer(model.parameters(), 0.05), other(model.parameters(), 0.05);
  initialize(model, optimizer, quiet_level(O1));
  auto loss = nll(model, batch(0));
  EXPECT_AMP_ERROR(amp::scale_loss(loss, other), "not passed to the live amp::initialize");
  EXPECT_AMP_ERROR(skipped_steps(other), "not passed to the live amp::initialize");
}

// A step while delay_unscale holds gradients scaled by the loss scale would
// apply them 65536 times too large; the optimizer sees none, so it changes
// nothing, and the accumulation goes on to the guard that ends it.
TEST_F(AdoptionMisuseTest, StepDuringDelayUnscaleAccumulationChangesNothing) {
  for (OptLevel level : {O1, O2}) {
    torch::manual_seed(0);
    Net model, reference;
    torch::optim::SGD optimizer(model.parameters(), 0.05);
    torch::optim::SGD reference_optimizer(reference.parameters(), 0.05);
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < model.parameters().size(); ++i) reference.parameters()[i].copy_(model.parameters()[i]);
    }
    Handle handle;
    handle.initialize(model, optimizer, quiet_level(level));
    const std::vector<at::Tensor> before = snapshot(model.parameters());
    optimizer.zero_grad();
    {
      amp::scale_loss scaled(nll(model, batch(0)), optimizer, {/*loss_id=*/0, /*delay_unscale=*/true});
      scaled.backward();
    }
    optimizer.step();  // too early
    EXPECT_TRUE(AllBitEqual(model.parameters(), before)) << to_string(level);
    {
      amp::scale_loss scaled(nll(model, batch(1)), optimizer);
      scaled.backward();
    }
    for (const auto& p : model.parameters()) ASSERT_TRUE(p.grad().defined());
    // The sum of both micro-batches, unscaled: as float32 within bf16's rounding.
    reference_optimizer.zero_grad();
    (nll(reference, batch(0)) + nll(reference, batch(1))).backward();
    for (size_t i = 0; i < model.parameters().size(); ++i) {
      const auto ours = model.parameters()[i].grad(), theirs = reference.parameters()[i].grad();
      EXPECT_TRUE(torch::allclose(ours, theirs, /*rtol=*/0.05, /*atol=*/0.02))
          << to_string(level) << " parameter " << i << " max diff " << (ours - theirs).abs().max().item<double>();
    }
  }
}

}  // namespace
}  // namespace amp::testing
