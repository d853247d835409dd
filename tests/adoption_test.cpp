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

constexpr int kSteps = 4;
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

::testing::AssertionResult AllBitEqual(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " vs " << b.size() << " tensors";
  for (size_t i = 0; i < a.size(); ++i) {
    auto result = BitEqual(a[i], b[i]);
    if (!result) return result << " (tensor " << i << ")";
  }
  return ::testing::AssertionSuccess();
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

// How the program clears gradients.
enum class ZeroGrad { kOptimizerFirst, kModelFirst, kOptimizerAfterForward, kNever };

struct Loop {
  int first_step = 0;
  int steps = kSteps;
  ZeroGrad zero_grad = ZeroGrad::kOptimizerFirst;
  // Called after each step() (LR schedulers).
  std::function<void()> after_step = [] {};
};

// Trains `model` (float32, not yet converted) with `optimizer` over its
// parameters as amp's `level` would, written by hand: native autocast
// (bf16 on the CPU), a static loss scale with gradients set aside,
// unscaled and added back as a guard does, and at O2/O3/O5 a converted
// model with fp32 masters stepped in place of its parameters.
template <class Model>
void train_by_hand(Model& model, torch::optim::Optimizer& optimizer, OptLevel level,
                   const std::function<torch::Tensor(Model&, const Batch&)>& loss_of,
                   const Loop& loop = {}) {
  const HandWritten h = hand_written(level);
  std::vector<std::pair<at::Tensor, at::Tensor>> lowered;  // (compute, master)
  if (h.model_dtype) {
    std::vector<at::Tensor> params = model.parameters(), before = snapshot(params);
    convert_model(model, *h.model_dtype, h.keep_batchnorm_fp32);
    for (size_t i = 0; h.masters && i < params.size(); ++i) {
      if (params[i].scalar_type() != *h.model_dtype) continue;
      at::Tensor master = before[i].requires_grad_(true);
      lowered.emplace_back(params[i], master);
      for (auto& group : optimizer.param_groups()) {
        for (auto& p : group.params()) {
          if (p.is_same(params[i])) p = master;
        }
      }
    }
  }
  auto stepped = [&] {
    std::vector<at::Tensor> out;
    for (const auto& group : optimizer.param_groups()) out.insert(out.end(), group.params().begin(), group.params().end());
    return out;
  };
  for (int step = loop.first_step; step < loop.first_step + loop.steps; ++step) {
    {
      torch::NoGradGuard no_grad;
      for (auto& [compute, master] : lowered) compute.copy_(master);
    }
    if (loop.zero_grad == ZeroGrad::kOptimizerFirst || loop.zero_grad == ZeroGrad::kModelFirst) {
      optimizer.zero_grad();
    }
    at::Tensor loss;
    {
      const bool was = at::autocast::is_autocast_enabled(at::kCPU);
      at::autocast::set_autocast_enabled(at::kCPU, h.autocast);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      loss = loss_of(model, batch(step));
      at::autocast::set_autocast_enabled(at::kCPU, was);
      at::autocast::clear_cache();
    }
    if (loop.zero_grad == ZeroGrad::kOptimizerAfterForward) optimizer.zero_grad();
    std::vector<at::Tensor> aside;
    for (auto& p : stepped()) aside.push_back(std::exchange(p.mutable_grad(), at::Tensor()));
    for (auto& [compute, master] : lowered) compute.mutable_grad() = at::Tensor();
    (loss.to(at::kFloat) * h.scale).backward();
    {
      torch::NoGradGuard no_grad;
      for (auto& [compute, master] : lowered) {
        if (compute.grad().defined()) master.mutable_grad() = compute.grad().to(at::kFloat);
      }
      std::vector<at::Tensor> params = stepped();
      for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor& grad = params[i].mutable_grad();
        if (grad.defined() && h.scale != 1.0) grad.mul_(1.0 / h.scale);
        if (aside[i].defined()) grad = grad.defined() ? grad.add_(aside[i]) : aside[i];
      }
    }
    optimizer.step();
    loop.after_step();
  }
  torch::NoGradGuard no_grad;
  for (auto& [compute, master] : lowered) compute.set_data(master.detach());  // float32 for comparing
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
  train_epoch(model, optimizer, kSteps);
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
  for (int step = 0; step < kSteps; ++step) {
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
      for (int step = 0; step < kSteps; ++step) {
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
  for (int step = 0; step < kSteps; ++step) {
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

INSTANTIATE_TEST_SUITE_P(Levels, AdoptionTest, ::testing::Values(O0, O1, O2, O3, O4, O5),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace amp::testing
