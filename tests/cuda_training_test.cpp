// SPDX-License-Identifier: BSD-3-Clause
// What a GPU user meets when training with amp on CUDA: conv + BatchNorm
// nets at O2, the fused optimizers' other variants, recurrent nets at the
// float16 and bfloat16 levels, checkpoints of CUDA state, a side stream, a
// loss computed on the CPU, and a whole step captured in a CUDA graph. Each test skips, saying so, without a CUDA
// device.
#include "test_util.h"

#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>

#include <limits>

namespace amp::testing {
namespace {

class CudaTrainingTest : public AmpTest {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  }
};

// A TinyNet on the GPU with amp's FusedAdamW, initialized at `level`.
struct FusedCudaRun {
  explicit FusedCudaRun(OptLevel level) {
    model->to(torch::kCUDA);  // in place: the optimizer holds the same parameters
    amp::Options options(level);
    options.verbosity = 0;
    handle.initialize(model, optimizer, options);
  }
  TinyNet model;
  amp::optim::FusedAdamW optimizer{model->parameters(), torch::optim::AdamWOptions(1e-2)};
  Handle handle;
};

// One training step on `x`, as users write it: zero_grad, forward, the
// guard around backward, step.
void train_step(TinyNet& model, torch::optim::Optimizer& optimizer, const at::Tensor& x) {
  optimizer.zero_grad();
  {
    scale_loss scaled(model(x).to(at::kFloat).pow(2).mean(), optimizer);
    scaled.backward();
  }
  optimizer.step();
}

struct ConvBnNetImpl : torch::nn::Module {
  ConvBnNetImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1).bias(false)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(16))),
        fc(register_module("fc", torch::nn::Linear(16, 10))) {}
  at::Tensor forward(const at::Tensor& x) {
    return fc(torch::adaptive_avg_pool2d(torch::relu(bn(conv(x))), {1, 1}).flatten(1));
  }
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
  torch::nn::Linear fc;
};
TORCH_MODULE(ConvBnNet);

// O2 runs the convolution in float16 into cuDNN's BatchNorm with float32
// parameters and statistics. Three SGD steps land within float16's reach of
// the float32 run and of native autocast's.
TEST_F(CudaTrainingTest, ConvBatchNormAtO2TrainsLikeFloat32AndNativeAutocast) {
  const auto x = torch::randn({32, 3, 16, 16}, torch::kCUDA);
  const auto y = torch::randint(0, 10, {32}, torch::TensorOptions(torch::kCUDA).dtype(torch::kLong));
  auto run = [&](const char* how) {
    torch::manual_seed(0);
    ConvBnNet model;
    model->to(torch::kCUDA);
    torch::optim::SGD optimizer(model->parameters(), 0.05);
    Handle handle;
    if (std::string(how) == "O2") handle.initialize(model, optimizer, quiet(O2));
    for (int step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      if (std::string(how) == "native") {
        at::autocast::set_autocast_enabled(at::kCUDA, true);
        const auto loss = torch::cross_entropy_loss(model(x), y);
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        at::autocast::clear_cache();
        loss.backward();
      } else if (std::string(how) == "O2") {
        const auto logits = model(x);
        EXPECT_EQ(logits.scalar_type(), at::kHalf);
        scale_loss scaled(torch::cross_entropy_loss(logits.to(at::kFloat), y), optimizer);
        scaled.backward();
      } else {
        torch::cross_entropy_loss(model(x), y).backward();
      }
      optimizer.step();
    }
    EXPECT_EQ(model->bn->running_mean.scalar_type(), at::kFloat);
    EXPECT_EQ(model->bn->weight.scalar_type(), at::kFloat);
    std::vector<at::Tensor> out = clones(model->parameters());
    out.push_back(model->bn->running_mean.clone());
    out.push_back(model->bn->running_var.clone());
    return out;
  };
  const auto fp32 = run("fp32"), native = run("native"), o2 = run("O2");
  EXPECT_TRUE(AllClose(o2, fp32, 2e-2, 2e-3));
  EXPECT_TRUE(AllClose(o2, native, 2e-2, 2e-3));
}

// FusedSGD with momentum and nesterov, FusedAdam with amsgrad: on the GPU
// they follow LibTorch's own step, skip an overflowed step on the device
// bit-identically, and never make the host wait.
TEST_F(CudaTrainingTest, FusedNesterovAndAmsgradFollowLibTorchsStepOnTheDevice) {
  using Make = std::function<OptimizerPtr(const std::vector<at::Tensor>&, bool fused)>;
  const std::vector<std::pair<std::string, Make>> cases = {
      {"SGD nesterov", [](const auto& p, bool fused) -> OptimizerPtr {
         const auto o = torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-4);
         if (fused) return std::make_shared<amp::optim::FusedSGD>(p, o);
         return std::make_shared<torch::optim::SGD>(p, o);
       }},
      {"Adam amsgrad", [](const auto& p, bool fused) -> OptimizerPtr {
         const auto o = torch::optim::AdamOptions(1e-2).amsgrad(true).weight_decay(1e-4);
         if (fused) return std::make_shared<amp::optim::FusedAdam>(p, o);
         return std::make_shared<torch::optim::Adam>(p, o);
       }},
  };
  for (const auto& [name, make] : cases) {
    SCOPED_TRACE(name);
    std::vector<std::vector<at::Tensor>> runs;
    for (bool fused : {true, false}) {
      torch::manual_seed(0);
      TinyNet model;
      model->to(torch::kCUDA);
      OptimizerPtr optimizer = make(model->parameters(), fused);
      Handle handle;
      std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
      torch::manual_seed(1);
      const int64_t syncs = host_syncs();
      std::vector<at::Tensor> before_skip;
      for (int step = 0; step < 6; ++step) {
        optimizer->zero_grad();
        {
          scale_loss scaled(model(torch::randn({16, 8}, torch::kCUDA)).to(at::kFloat).pow(2).mean(), optimizer);
          scaled.backward();
          if (step == 3) model->fc1->weight.mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
        }
        if (step == 3) before_skip = clones(model->parameters());
        optimizer->step();
        if (step == 3) {
          const auto after = model->parameters();
          for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(BitEqual(after[i], before_skip[i]));
        }
      }
      EXPECT_EQ(host_syncs() - syncs, fused ? 0 : 6);
      EXPECT_EQ(skipped_steps(*optimizer), 1);
      runs.push_back(clones(model->parameters()));
    }
    EXPECT_TRUE(AllClose(runs[0], runs[1], 1e-5, 1e-6));
  }
}

// nn::LSTM and nn::GRU run through cuDNN: at O1 in float16 and at O4 in
// bfloat16 - the level's dtype, whatever LibTorch's own autocast kernel for
// cuDNN RNNs would pick - within that dtype's reach of float32.
TEST_F(CudaTrainingTest, RecurrentNetsRunInTheLevelsDtype) {
  // bfloat16 cuDNN RNNs need cuDNN 9.13; before it amp runs them in float32.
  const at::ScalarType bf16_rnn =
      at::detail::getCUDAHooks().supportsBFloat16RNNWithCuDNN() ? at::kBFloat16 : at::kFloat;
  for (OptLevel level : {O1, O4}) {
    const at::ScalarType low = level == O4 ? bf16_rnn : at::kHalf;
    const double tolerance = level == O4 ? 5e-2 : 1e-2;
    for (const std::string kind : {"LSTM", "GRU"}) {
      SCOPED_TRACE(std::string(to_string(level)) + " " + kind);
      torch::manual_seed(0);
      const auto x = torch::randn({12, 4, 8}, torch::kCUDA);
      std::shared_ptr<torch::nn::Module> net;
      std::function<at::Tensor()> forward;
      if (kind == "LSTM") {
        torch::nn::LSTM lstm(8, 16);
        lstm->to(torch::kCUDA);
        net = lstm.ptr();
        forward = [lstm, x]() mutable { return std::get<0>(lstm->forward(x)); };
      } else {
        torch::nn::GRU gru(8, 16);
        gru->to(torch::kCUDA);
        net = gru.ptr();
        forward = [gru, x]() mutable { return std::get<0>(gru->forward(x)); };
      }
      const at::Tensor want = forward().detach();
      Handle handle;
      handle.initialize(net, quiet(level));
      WarningRecorder warnings;  // amp passes cuDNN unpacked weights on purpose: no warning
      const at::Tensor got = forward();
      EXPECT_EQ(warnings.messages(), std::vector<std::string>{});
      EXPECT_EQ(got.scalar_type(), low);
      EXPECT_TRUE(AllClose({got.to(at::kFloat)}, {want}, tolerance, tolerance));
      got.to(at::kFloat).sum().backward();
      for (const auto& p : net->parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
    }
  }
}

// A checkpoint of CUDA state (O2 weights, FusedAdam's moments and device
// step counts, the scaler) resumes bit for bit.
TEST_F(CudaTrainingTest, CheckpointOfCudaStateResumesBitForBit) {
  const std::string file = temp_path("cuda_checkpoint.pt");
  auto train = [&](TinyNet& model, torch::optim::Optimizer& optimizer, int from, int to) {
    for (int step = from; step < to; ++step) {
      torch::manual_seed(100 + step);
      train_step(model, optimizer, torch::randn({16, 8}, torch::kCUDA));
    }
  };
  torch::manual_seed(0);
  TinyNet straight;
  straight->to(torch::kCUDA);
  amp::optim::FusedAdam straight_optimizer(straight->parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<at::Tensor> resumed_params;
  {
    Handle handle;
    handle.initialize(straight, straight_optimizer, quiet(O2));
    train(straight, straight_optimizer, 0, 3);
    save_checkpoint(file, {straight}, {straight_optimizer});
    train(straight, straight_optimizer, 3, 6);
  }
  torch::manual_seed(7);  // other initial weights: the checkpoint must replace them
  TinyNet resumed;
  resumed->to(torch::kCUDA);
  amp::optim::FusedAdam resumed_optimizer(resumed->parameters(), torch::optim::AdamOptions(1e-2));
  Handle handle;
  handle.initialize(resumed, resumed_optimizer, quiet(O2));
  load_checkpoint(file, {resumed}, {resumed_optimizer});
  train(resumed, resumed_optimizer, 3, 6);
  const auto a = straight->parameters(), b = resumed->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(BitEqual(a[i], b[i])) << "parameter " << i;
  std::remove(file.c_str());
}

// Training on a side stream gives the default stream's result bit for bit
// (the cast cache and the scaler's tensors follow the current stream).
TEST_F(CudaTrainingTest, ASideStreamTrainsAsTheDefaultStream) {
  auto run = [](bool side) {
    torch::manual_seed(0);
    FusedCudaRun net(O2);
    TinyNet& model = net.model;
    amp::optim::FusedAdamW& optimizer = net.optimizer;
    std::optional<c10::cuda::CUDAStreamGuard> guard;
    if (side) guard.emplace(c10::cuda::getStreamFromPool());
    for (int step = 0; step < 4; ++step) {
      torch::manual_seed(step + 1);
      train_step(model, optimizer, torch::randn({16, 8}, torch::kCUDA));
    }
    torch::cuda::synchronize();
    return clones(model->parameters());
  };
  const auto side = run(true), main = run(false);
  for (size_t i = 0; i < side.size(); ++i) EXPECT_TRUE(BitEqual(side[i], main[i])) << "parameter " << i;
}

// A loss moved to the CPU: training is right, and the copy of the overflow
// flag to the CPU is counted as the wait it is.
TEST_F(CudaTrainingTest, ALossOnTheCpuCountsItsWait) {
  torch::manual_seed(0);
  TinyNet model;
  model->to(torch::kCUDA);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  Handle handle;
  handle.initialize(model, optimizer, quiet(O1));
  const auto before = clones(model->parameters());
  const int64_t syncs = host_syncs();
  optimizer.zero_grad();
  {
    scale_loss scaled(model(torch::randn({16, 8}, torch::kCUDA)).to(at::kFloat).pow(2).mean().cpu(), optimizer);
    scaled.backward();
  }
  optimizer.step();
  EXPECT_EQ(host_syncs() - syncs, 2) << "the flag's copy to the CPU, then the step's read";
  EXPECT_FALSE(last_step_skipped(optimizer));
  EXPECT_FALSE(BitEqual(model->fc1->weight, before[0]));
}

// A whole training step (forward, scale_loss, fused step) captured in a
// CUDA graph and replayed gives what the same steps give run eagerly, bit
// for bit: parameters, Adam's step counts, skipped steps and the loss scale,
// an overflow at one replay skipped inside the graph.
TEST_F(CudaTrainingTest, AStepCapturedInACudaGraphReplaysAsTheEagerSteps) {
  constexpr int kWarmUp = 3, kSteps = 6, kOverflowAt = 5;  // that step's input holds an inf
  struct Outcome {
    std::vector<at::Tensor> params;
    std::vector<int64_t> step_counts;
    int64_t skipped = 0;
    bool last_skipped = false;
    double scale = 0;
  };
  auto run = [&](OptLevel level, bool graphed) {
    torch::manual_seed(0);
    FusedCudaRun net(level);
    TinyNet& model = net.model;
    amp::optim::FusedAdamW& optimizer = net.optimizer;
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());  // graphs capture off the default stream
    at::Tensor x = torch::empty({16, 8}, torch::kCUDA);
    auto feed = [&](int step) {
      torch::manual_seed(step + 1);
      x.copy_(torch::randn({16, 8}));
      if (step == kOverflowAt) x[0][0].fill_(std::numeric_limits<float>::infinity());
    };
    auto step = [&] { train_step(model, optimizer, x); };
    int s = 0;
    for (; s < kWarmUp; ++s) feed(s), step();
    (void)skipped_steps(optimizer);  // the warm-up's outcome known before capturing
    eager_or_replayed(graphed, s, kWarmUp + kSteps, feed, step);
    Outcome out;
    out.skipped = skipped_steps(optimizer);
    out.last_skipped = last_step_skipped(optimizer);
    out.scale = loss_scaler()->scale();
    for (const auto& p : model->parameters()) {
      out.step_counts.push_back(static_cast<torch::optim::AdamWParamState&>(
          *optimizer.state().at(p.unsafeGetTensorImpl())).step());
    }
    out.params = clones(model->parameters());
    return out;
  };
  for (OptLevel level : {O1, O2}) {
    SCOPED_TRACE(to_string(level));
    const Outcome eager = run(level, false), graphed = run(level, true);
    EXPECT_GE(eager.skipped, 1) << "the injected overflow skips a step";
    EXPECT_EQ(graphed.skipped, eager.skipped);
    EXPECT_EQ(graphed.last_skipped, eager.last_skipped);
    EXPECT_EQ(graphed.scale, eager.scale);
    EXPECT_EQ(graphed.step_counts, eager.step_counts);
    for (size_t i = 0; i < eager.params.size(); ++i) {
      EXPECT_TRUE(BitEqual(graphed.params[i], eager.params[i])) << "parameter " << i;
    }
  }
}

// What a capture cannot hold is refused with an error that says which, and
// amp trains on eagerly afterwards.
TEST_F(CudaTrainingTest, CapturingWhatCannotBeCapturedSaysWhich) {
  auto step = [](TinyNet& model, torch::optim::Optimizer& optimizer) {
    train_step(model, optimizer, torch::randn({16, 8}, torch::kCUDA));
  };
  auto refused = [&](TinyNet& model, torch::optim::Optimizer& optimizer) {
    at::cuda::CUDAGraph graph;
    std::string error;
    graph.capture_begin();
    try {
      step(model, optimizer);
    } catch (const c10::Error& e) {
      error = e.what();
    }
    graph.capture_end();
    return error;
  };
  c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
  {
    TinyNet model;
    model->to(torch::kCUDA);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    Handle handle;
    handle.initialize(model, optimizer, quiet(O1));
    step(model, optimizer);
    EXPECT_THAT(refused(model, optimizer), ::testing::HasSubstr("one of its optimizers is LibTorch's own"));
  }
  {
    FusedCudaRun net(O1);
    TinyNet& model = net.model;
    amp::optim::FusedAdamW& optimizer = net.optimizer;
    EXPECT_THAT(refused(model, optimizer), ::testing::HasSubstr("Run warm-up iterations"));
    const auto before = clones(model->parameters());
    step(model, optimizer);
    EXPECT_FALSE(last_step_skipped(optimizer));
    EXPECT_FALSE(BitEqual(model->fc1->weight, before[0])) << "eager training goes on";
  }
  {  // O6 after warm-up: its stochastic rounding would replay one step's noise
    FusedCudaRun net(O6);
    TinyNet& model = net.model;
    amp::optim::FusedAdamW& optimizer = net.optimizer;
    step(model, optimizer);
    (void)skipped_steps(optimizer);
    EXPECT_THAT(refused(model, optimizer), ::testing::HasSubstr("draw fresh noise every step"));
    const auto before = clones(model->parameters());
    step(model, optimizer);
    EXPECT_FALSE(last_step_skipped(optimizer));
    EXPECT_FALSE(BitEqual(model->fc1->weight, before[0])) << "eager training goes on";
  }
}

}  // namespace
}  // namespace amp::testing
