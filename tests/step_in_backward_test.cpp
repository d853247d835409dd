// SPDX-License-Identifier: BSD-3-Clause
// Properties::step_in_backward: the loop users write, run with and without
// it, ends bit for bit the same (weights and optimizer state) at the levels
// that allow it, with recomputation (whole blocks, or in slices of the
// batch: each weight still stepped once), schedulers, zero_grad either way, two
// models and losses, and a resumed checkpoint; the gradients are freed as
// they are applied (the allocator's bytes); what cannot step in backward is
// refused with its error.
#include "test_util.h"
#include "world_of_one.h"

#include <amp/memory.h>

#include <torch/cuda.h>
#include <torch/optim/schedulers/step_lr.h>

#include <cstdio>

namespace amp::testing {
namespace {

// Linear, BatchNorm, two residual blocks with dropout, a head, and a gain
// used at both ends (its gradient sums two paths before it is final).
struct InBackwardNetImpl : torch::nn::Module {
  // slices > 1: the blocks recomputed in that many slices of the batch.
  explicit InBackwardNetImpl(bool recompute, int64_t slices = 0)
      : in(register_module("input", torch::nn::Linear(12, 64))),
        bn(register_module("bn", torch::nn::BatchNorm1d(64))),
        up1(register_module("up1", torch::nn::Linear(64, 128))),
        down1(register_module("down1", torch::nn::Linear(128, 64))),
        up2(register_module("up2", torch::nn::Linear(64, 128))),
        down2(register_module("down2", torch::nn::Linear(128, 64))),
        drop(register_module("drop", torch::nn::Dropout(0.2))),
        head(register_module("head", torch::nn::Linear(64, 5))),
        gain(register_parameter("gain", torch::ones({64}))),
        recompute_(recompute),
        slices_(slices) {}
  at::Tensor block(const at::Tensor& x, torch::nn::Linear& up, torch::nn::Linear& down) {
    return x + down(drop(torch::gelu(up(x))));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::relu(bn(in(x))) * gain;
    auto first = [this](const at::Tensor& t) { return block(t, up1, down1); };
    auto second = [this](const at::Tensor& t) { return block(t, up2, down2); };
    if (slices_ > 1) {
      h = amp::recompute_in_slices(slices_, [first, second](const at::Tensor& t) { return second(first(t)); }, h);
    } else {
      h = recompute_ ? amp::recompute(second, amp::recompute(first, h)) : second(first(h));
    }
    return head(h * gain);
  }
  torch::nn::Linear in;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear up1, down1, up2, down2;
  torch::nn::Dropout drop;
  torch::nn::Linear head;
  at::Tensor gain;
  bool recompute_;
  int64_t slices_;
};
TORCH_MODULE(InBackwardNet);

enum class Kind { kAdamW, kAdam, kSgd };

std::shared_ptr<torch::optim::Optimizer> make_optimizer(Kind kind, InBackwardNet& model) {
  switch (kind) {
    case Kind::kAdamW:
      return std::make_shared<amp::optim::FusedAdamW>(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
    case Kind::kAdam:
      return std::make_shared<amp::optim::FusedAdam>(model->parameters(), torch::optim::AdamOptions(3e-3).amsgrad(true));
    case Kind::kSgd:
      return std::make_shared<amp::optim::FusedSGD>(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return nullptr;
}

struct Case {
  std::string name;
  Options options;
  Kind kind;
  bool recompute;
  int64_t slices = 0;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

Options with(Options o, const std::function<void(Options&)>& change = nullptr) {
  o.verbosity = 0;
  if (change) change(o);
  return o;
}

struct Trained {
  std::vector<at::Tensor> params, state, losses;
};

// The loop as users write it: zero_grad (to none, or to zeros every other
// step), forward, a guard around backward, step, the scheduler; with
// `resume_at`, amp's checkpoint saved there and loaded into a fresh model,
// optimizer and initialization.
Trained train(const Case& c, bool in_backward, int steps = 5, int resume_at = -1, c10::Device device = c10::kCPU) {
  Options options = c.options;
  options.step_in_backward = in_backward;
  torch::manual_seed(0);
  if (device.is_cuda()) torch::cuda::manual_seed_all(0);
  auto model = std::make_shared<InBackwardNet>(c.recompute, c.slices);
  (*model)->to(device);
  auto optimizer = make_optimizer(c.kind, *model);
  auto scheduler = std::make_unique<torch::optim::StepLR>(*optimizer, 2, 0.5);
  auto handle = std::make_unique<Handle>();
  handle->initialize(*model, *optimizer, options);
  const std::string path = temp_path("step_in_backward_resume.pt");
  Trained out;
  for (int step = 0; step < steps; ++step) {
    if (step == resume_at) {
      save_checkpoint(path, {*model}, {*optimizer});
      handle.reset();
      torch::manual_seed(1);
      model = std::make_shared<InBackwardNet>(c.recompute, c.slices);
      (*model)->to(device);
      optimizer = make_optimizer(c.kind, *model);
      scheduler = std::make_unique<torch::optim::StepLR>(*optimizer, 2, 0.5);
      handle = std::make_unique<Handle>();
      handle->initialize(*model, *optimizer, options);
      for (int epoch = 0; epoch < step; ++epoch) scheduler->step();  // the scheduler where it was
      load_checkpoint(path, {*model}, {*optimizer});
      std::remove(path.c_str());
    }
    torch::manual_seed(100 + step);
    const at::Tensor x = torch::randn({16, 12}).to(device);
    const at::Tensor y = torch::randint(0, 5, {16}).to(device);
    optimizer->zero_grad(/*set_to_none=*/step % 2 == 0);
    const at::Tensor loss = torch::cross_entropy_loss((*model)->forward(x), y);
    {
      scale_loss scaled(loss, *optimizer);
      scaled.backward();
    }
    optimizer->step();
    scheduler->step();
    out.losses.push_back(loss.detach().clone());
  }
  out.params = clones((*model)->parameters());
  out.state = clones(optimizer_state_tensors(*optimizer));
  return out;
}

class StepInBackwardCase : public AmpTest, public ::testing::WithParamInterface<Case> {};

TEST_P(StepInBackwardCase, EndsBitForBitAsTheOrdinaryStep) {
  const Case& c = GetParam();
  const Trained ordinary = train(c, false), in_backward = train(c, true);
  expect_bit_equal(in_backward.losses, ordinary.losses, "loss");
  expect_bit_equal(in_backward.params, ordinary.params, "parameter");
  expect_bit_equal(in_backward.state, ordinary.state, "optimizer state");
  EXPECT_FALSE(BitEqual(ordinary.params.front(), train(c, false, 1).params.front()));  // it trained
}

INSTANTIATE_TEST_SUITE_P(
    Levels, StepInBackwardCase,
    ::testing::Values(
        Case{"O6_AdamW", with(O6), Kind::kAdamW, false},
        Case{"O6_AdamW_recompute", with(O6), Kind::kAdamW, true},
        Case{"O6_AdamW_8bit_recompute", with(O6, [](Options& o) { o.optimizer_state_dtype = at::kByte; }),
             Kind::kAdamW, true},
        Case{"O6_SGD_float32_state", with(O6, [](Options& o) { o.optimizer_state_dtype = at::kFloat; }), Kind::kSgd,
             false},
        Case{"O6_AdamW_8bit_recompute_in_slices", with(O6, [](Options& o) { o.optimizer_state_dtype = at::kByte; }),
             Kind::kAdamW, true, 4},
        Case{"O4_Adam_amsgrad_recompute", with(O4), Kind::kAdam, true},
        Case{"O4_SGD_recompute_in_slices", with(O4), Kind::kSgd, true, 3},
        Case{"O4_AdamW_8bit", with(O4, [](Options& o) { o.optimizer_state_dtype = at::kByte; }), Kind::kAdamW, false},
        Case{"O1_static_scale_128_SGD", with(O1, [](Options& o) { o.loss_scale = LossScale::Static(128); }),
             Kind::kSgd, true},
        Case{"O0_AdamW", with(O0), Kind::kAdamW, false},
        Case{"O3_AdamW", with(O3), Kind::kAdamW, false}),
    [](const auto& info) { return info.param.name; });

// On the GPU the hooks run on the autograd engine's device thread, and the
// kernels on the backward's stream.
TEST_F(AmpTest, OnCudaStepInBackwardEndsBitForBitAsTheOrdinaryStep) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  for (const bool eight_bit : {false, true}) {
    const Case c{"O6", with(O6, [&](Options& o) { if (eight_bit) o.optimizer_state_dtype = at::kByte; }),
                 Kind::kAdamW, true};
    const Trained ordinary = train(c, false, 5, -1, c10::kCUDA), in_backward = train(c, true, 5, -1, c10::kCUDA);
    expect_bit_equal(in_backward.params, ordinary.params, "parameter");
    expect_bit_equal(in_backward.state, ordinary.state, "optimizer state");
  }
}

// amp's checkpoint in the middle: the resumed run ends as the uninterrupted
// one (the rounding streams and 8-bit state travel in it).
TEST_F(AmpTest, StepInBackwardResumesBitForBit) {
  const Case c{"O6_8bit", with(O6, [](Options& o) { o.optimizer_state_dtype = at::kByte; }), Kind::kAdamW, true};
  const Trained whole = train(c, true, 5), resumed = train(c, true, 5, /*resume_at=*/3);
  expect_bit_equal(resumed.params, whole.params, "parameter");
  expect_bit_equal(resumed.state, whole.state, "optimizer state");
}

// A checkpoint saved between the guard and step() (the update already
// applied) resumes as the uninterrupted run: the resumed step() applies
// nothing and draws no rounding step.
TEST_F(AmpTest, StepInBackwardResumesFromACheckpointSavedBeforeStep) {
  auto run = [](bool resume) {
    torch::manual_seed(0);
    auto model = std::make_shared<InBackwardNet>(false);
    auto optimizer = make_optimizer(Kind::kAdamW, *model);
    const Options options = with(O6, [](Options& o) { o.step_in_backward = true; });
    auto handle = std::make_unique<Handle>();
    handle->initialize(*model, *optimizer, options);
    const std::string path = temp_path("step_in_backward_before_step.pt");
    for (int step = 0; step < 4; ++step) {
      torch::manual_seed(100 + step);
      const at::Tensor x = torch::randn({16, 12}), y = torch::randint(0, 5, {16});
      optimizer->zero_grad();
      {
        scale_loss scaled(torch::cross_entropy_loss((*model)->forward(x), y), *optimizer);
        scaled.backward();
      }
      if (resume && step == 1) {
        save_checkpoint(path, {*model}, {*optimizer});
        handle.reset();
        model = std::make_shared<InBackwardNet>(false);
        optimizer = make_optimizer(Kind::kAdamW, *model);
        handle = std::make_unique<Handle>();
        handle->initialize(*model, *optimizer, options);
        load_checkpoint(path, {*model}, {*optimizer});
        std::remove(path.c_str());
      }
      optimizer->step();
    }
    return std::make_pair(clones((*model)->parameters()), clones(optimizer_state_tensors(*optimizer)));
  };
  const auto whole = run(false), resumed = run(true);
  expect_bit_equal(resumed.first, whole.first, "parameter");
  expect_bit_equal(resumed.second, whole.second, "optimizer state");
}

// A GAN's loop: the discriminator's guard and step, then the generator's
// loss through the discriminator in a guard over the generator's optimizer
// alone (the discriminator's gradients from it are left to its zero_grad).
TEST_F(AmpTest, StepInBackwardTrainsAGanAsTheOrdinaryStep) {
  auto run = [](bool in_backward) {
    torch::manual_seed(3);
    torch::nn::Sequential g(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 16));
    torch::nn::Sequential d(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1));
    amp::optim::FusedAdamW g_opt(g->parameters(), torch::optim::AdamWOptions(1e-3));
    amp::optim::FusedAdamW d_opt(d->parameters(), torch::optim::AdamWOptions(1e-3));
    Options options = with(O6);
    options.num_losses = 2;
    options.step_in_backward = in_backward;
    Handle handle;
    handle.initialize({g, d}, {g_opt, d_opt}, options);
    for (int step = 0; step < 4; ++step) {
      const at::Tensor real = torch::randn({8, 16}), z = torch::randn({8, 8});
      d_opt.zero_grad();
      const at::Tensor fake = g->forward(z);
      const at::Tensor d_loss = torch::softplus(-d->forward(real)).mean() + torch::softplus(d->forward(fake.detach())).mean();
      {
        scale_loss scaled(d_loss, d_opt, {.loss_id = 0});
        scaled.backward();
      }
      d_opt.step();
      g_opt.zero_grad();
      const at::Tensor g_loss = torch::softplus(-d->forward(fake)).mean();
      {
        scale_loss scaled(g_loss, g_opt, {.loss_id = 1});
        scaled.backward();
      }
      g_opt.step();
    }
    std::vector<at::Tensor> params = clones(g->parameters());
    for (const at::Tensor& p : clones(d->parameters())) params.push_back(p);
    return params;
  };
  expect_bit_equal(run(true), run(false), "parameter");
}

// A weight's gradient is gone once it is applied: while backward runs no
// parameter holds one (each is stepped and freed before the next is
// produced), the guard leaves none, and step() changes nothing more.
TEST_F(AmpTest, StepInBackwardFreesEachGradientAsItIsApplied) {
  torch::manual_seed(0);
  InBackwardNet model(false);
  amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  Handle handle;
  handle.initialize(model, optimizer, with(O6, [](Options& o) { o.step_in_backward = true; }));
  int most_held = 0, hooks_run = 0;
  std::vector<at::Tensor> params = model->parameters();
  for (at::Tensor& p : params) {
    p.register_hook([&](const at::Tensor&) {
      int held = 0;
      for (const at::Tensor& q : params) held += q.grad().defined() ? 1 : 0;
      most_held = std::max(most_held, held);
      ++hooks_run;
    });
  }
  const at::Tensor before = model->up1->weight.detach().clone();
  const at::Tensor loss = model->forward(torch::randn({16, 12})).pow(2).mean();
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();
    EXPECT_FALSE(BitEqual(model->up1->weight, before));  // stepped during backward
  }
  EXPECT_EQ(hooks_run, static_cast<int>(params.size()));
  EXPECT_EQ(most_held, 0);
  for (const at::Tensor& p : params) EXPECT_FALSE(p.grad().defined());
  const std::vector<at::Tensor> after_guard = clones(params);
  optimizer.step();
  expect_bit_equal(clones(params), after_guard, "parameter after step()");
}

// The allocator's peak over an iteration's backward and step, above what
// the model, its state and the forward hold: the whole gradient without the
// option (float32 weights at O0, so no widening transient), about one
// layer's with it.
TEST_F(AmpTest, StepInBackwardHoldsOneGradientNotAll) {
  amp::track_allocations();
  int64_t gradient_bytes = 0;
  auto peak = [&](bool in_backward) {
    torch::manual_seed(0);
    torch::nn::Sequential layers;
    for (int i = 0; i < 8; ++i) layers->push_back(torch::nn::Linear(256, 256));
    amp::optim::FusedAdamW optimizer(layers->parameters(), torch::optim::AdamWOptions(1e-3));
    Handle handle;
    handle.initialize(layers, optimizer, with(O0, [&](Options& o) { o.step_in_backward = in_backward; }));
    gradient_bytes = 0;
    for (const at::Tensor& p : layers->parameters()) gradient_bytes += p.numel() * 4;
    int64_t result = 0;
    for (int step = 0; step < 2; ++step) {  // the first creates the state
      optimizer.zero_grad();
      const at::Tensor loss = layers->forward(torch::randn({4, 256})).pow(2).mean();
      reset_peak_allocated();
      const int64_t start = allocated_bytes().current;
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      result = allocated_bytes().peak - start;
    }
    return result;
  };
  const int64_t ordinary = peak(false), in_backward = peak(true);
  std::printf("peak bytes above the iteration's start: %lld ordinary, %lld stepping in backward; gradients %lld\n",
              static_cast<long long>(ordinary), static_cast<long long>(in_backward),
              static_cast<long long>(gradient_bytes));
  EXPECT_GE(ordinary, gradient_bytes * 9 / 10);  // less the activations backward frees
  EXPECT_LT(in_backward, gradient_bytes / 4);  // a layer's: 1/8
}

// An exception in the middle of backward: the layers backward had reached
// stay stepped (an update cannot be taken back), the guard unwinds, and the
// next iteration runs.
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("user backward failed");
  }
};

TEST_F(AmpTest, StepInBackwardKeepsWhatItAppliedWhenBackwardThrows) {
  torch::manual_seed(0);
  torch::nn::Linear first(8, 8), last(8, 8);
  std::vector<at::Tensor> params = first->parameters();
  for (const at::Tensor& p : last->parameters()) params.push_back(p);
  amp::optim::FusedSGD optimizer(params, torch::optim::SGDOptions(0.1));
  Handle handle;
  handle.initialize({first, last}, {optimizer}, with(O4, [](Options& o) { o.step_in_backward = true; }));
  const at::Tensor first_before = first->weight.detach().clone(), last_before = last->weight.detach().clone();
  const at::Tensor loss = last(ThrowInBackward::apply(first(torch::randn({4, 8})))).sum();
  EXPECT_THROW(
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      },
      std::exception);
  EXPECT_FALSE(BitEqual(last->weight, last_before));  // reached before the throw
  EXPECT_TRUE(BitEqual(first->weight, first_before));
  const at::Tensor next = last(first(torch::randn({4, 8}))).sum();
  {
    scale_loss scaled(next, optimizer);
    scaled.backward();
  }
  optimizer.step();
  EXPECT_FALSE(BitEqual(first->weight, first_before));
}

TEST_F(AmpTest, StepInBackwardRefusesWhatCannotStepDuringBackward) {
  torch::manual_seed(0);
  TinyNet model;
  amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto options = [](Options o) {
    o.verbosity = 0;
    o.step_in_backward = true;
    return o;
  };
  // At initialize, nothing initialized.
  EXPECT_AMP_ERROR(initialize(model, optimizer, options(O1)), "dynamic loss scale may skip the step");
  EXPECT_AMP_ERROR(initialize(model, optimizer, options(O5)), "keeps float32 master weights");
  EXPECT_AMP_ERROR(initialize(model, optimizer, options(O2)), "dynamic loss scale may skip the step");
  torch::optim::SGD plain(model->parameters(), 0.1);
  EXPECT_AMP_ERROR(initialize(model, plain, options(O4)), "this optimizer is LibTorch's own");
  Options telemetry = options(O4);
  telemetry.precision_telemetry = true;
  EXPECT_AMP_ERROR(initialize(model, optimizer, telemetry), "read the gradients after backward");
  amp::optim::FusedSGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_AMP_ERROR(initialize(model, sgd, options(O3)), "CPU SGD kernel does not step");
  Options reduced = options(O4);
  reduced.reduce_overflow = [](at::Tensor&) {};
  EXPECT_AMP_ERROR(initialize(model, optimizer, reduced), "every rank's backward");
  Options replicated = options(O6);
  replicated.data_parallel.group = c10::make_intrusive<WorldOfOne>();
  EXPECT_AMP_ERROR(initialize(model, optimizer, replicated), "Set data_parallel.shard");
  EXPECT_FALSE(is_initialized());

  Handle handle;
  handle.initialize(model, optimizer, options(O4));
  auto loss = [&] { return model->forward(torch::randn({4, 8})).pow(2).mean(); };
  const std::vector<at::Tensor> start = clones(model->parameters());
  EXPECT_AMP_ERROR(scale_loss guard(loss(), optimizer, {.delay_unscale = true}), "delay_unscale=true");
  expect_bit_equal(clones(model->parameters()), start, "after a refused guard");
  {
    scale_loss scaled(loss(), optimizer);
    scaled.backward();
    EXPECT_AMP_ERROR(scaled.unscale(), "applied each of them during backward");
    EXPECT_AMP_ERROR(clip_grad_norm(optimizer, 1.0), "needs every gradient at once");
  }
  // A second guard before step() would step twice in one iteration.
  EXPECT_AMP_ERROR(scale_loss guard(loss(), optimizer), "has not been called since");
  optimizer.step();
  {
    scale_loss scaled(loss(), optimizer);
    const at::Tensor twice = scaled.scaled_loss();
    twice.backward({}, /*retain_graph=*/true);
    EXPECT_AMP_ERROR(twice.backward(), "accumulated twice inside one scale_loss guard");
  }
}

}  // namespace
}  // namespace amp::testing
