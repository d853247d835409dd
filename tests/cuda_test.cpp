// SPDX-License-Identifier: BSD-3-Clause
// CUDA behaviour: representative ops of every CUDA policy against native
// autocast on the GPU, the banned op, O1/O2 training steps on CUDA, and the
// fused optimizer step deciding on the device.
// Each test skips, saying so, when no CUDA device is present.
#include "test_util.h"

#include <ATen/autocast_mode.h>
#include <torch/cuda.h>

namespace amp::testing {
namespace {

class CudaTest : public AmpTest {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  }
  at::Tensor r(at::IntArrayRef shape, at::ScalarType dtype = at::kFloat) {
    return torch::randn(shape, torch::device(torch::kCUDA)).to(dtype);
  }
};

TEST_F(CudaTest, RepresentativeOpsMatchNativeAutocastBitForBit) {
  std::vector<std::pair<std::string, std::function<at::Tensor()>>> cases;
  const auto x = r({8, 16}), w = r({4, 16}), b = r({4});
  const auto half = r({8, 16}, at::kHalf);
  const auto img = r({2, 3, 8, 8}), kernel = r({4, 3, 3, 3});
  const auto h = r({2, 5}), c = r({2, 5}), wi = r({20, 3}), wh = r({20, 5}), in = r({2, 3});
  cases = {
      {"mm", [&] { return at::mm(x, x.t()); }},
      {"linear", [&] { return at::linear(x, w, b); }},
      {"conv2d", [&] { return at::conv2d(img, kernel); }},
      {"lstm_cell", [&] { return std::get<0>(at::lstm_cell(in, {h, c}, wi, wh)); }},
      {"exp", [&] { return at::exp(half); }},
      {"layer_norm", [&] { return at::layer_norm(half, {16}); }},
      {"mse_loss", [&] { return at::mse_loss(half, half.flip(0)); }},
      {"softmax", [&] { return at::softmax(half, 1); }},
      {"sum", [&] { return at::sum(half); }},
      {"norm.Scalar", [&] { return at::norm(half, 2); }},
      {"addcmul", [&] { return at::addcmul(half, x, half); }},
      {"cat (native promotes)", [&] { return at::cat({half, x}); }},
  };
  for (auto& [name, call] : cases) {
    SCOPED_TRACE(name);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    const auto native = call();
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    Handle handle;
    handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
    const auto ours = call();
    handle.deinitialize();
    EXPECT_TRUE(BitEqual(ours, native));
  }
}

TEST_F(CudaTest, BinaryCrossEntropyIsBannedWithTheFix) {
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  const auto p = torch::rand({4}, torch::kCUDA) * 0.9 + 0.05, t = torch::rand({4}, torch::kCUDA);
  EXPECT_AMP_ERROR(torch::binary_cross_entropy(p, t), "binary_cross_entropy_with_logits");
  handle.deinitialize();
  Options allow = quiet(O1);
  allow.allow_banned = true;
  handle.initialize(std::vector<ModulePtr>{}, {}, allow);
  EXPECT_EQ(torch::binary_cross_entropy(p.to(at::kHalf), t.to(at::kHalf)).scalar_type(), at::kFloat);
}

TEST_F(CudaTest, TrainingStepsAtO1AndO2WithFp16AndBf16) {
  for (OptLevel level : {O1, O2, O4, O5}) {
    SCOPED_TRACE(to_string(level));
    auto model = TinyNet();
    model->to(torch::kCUDA);
    OptimizerPtr optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-3);
    Handle handle;
    std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(level));
    const at::ScalarType low = (level == O4 || level == O5) ? at::kBFloat16 : at::kHalf;
    for (int step = 0; step < 3; ++step) {
      optimizer->zero_grad();
      const auto out = model->forward(torch::randn({16, 8}, torch::kCUDA));
      EXPECT_EQ(out.scalar_type(), low);
      const bool masters = level == O2 || level == O5;
      // With masters the weights compute in the low dtype and rest in float32.
      if (masters) EXPECT_EQ(model->fc1->weight.scalar_type(), low);
      const auto loss = torch::mse_loss(out, torch::zeros_like(out));
      EXPECT_EQ(loss.scalar_type(), at::kFloat);
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer->step();
      if (masters) EXPECT_EQ(model->fc1->weight.scalar_type(), at::kFloat);
      // O4 (bfloat16 autocast over float32 weights) scales nothing, so its
      // scale never moves; every other level's lives on the gradients' device.
      if (level != O4) EXPECT_TRUE(loss_scaler()->device().is_cuda());
      if (level == O4) EXPECT_TRUE(loss_scaler()->device().is_cpu());
    }
    if (level == O2 || level == O5) {
      for (const auto& m : master_params(*optimizer)) EXPECT_EQ(m.scalar_type(), at::kFloat);
    }
  }
}

TEST_F(CudaTest, OverflowInFp16GradientsSkipsTheStep) {
  auto model = TinyNet();
  model->to(torch::kCUDA);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Options options = quiet(O3);
  options.loss_scale = LossScale::Dynamic();
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  const auto before = model->fc1->weight.clone();
  {
    scale_loss scaled(model->forward(torch::randn({4, 8}, torch::kCUDA)).to(at::kFloat).sum(), optimizer);
    scaled.backward();
    EXPECT_EQ(model->fc1->weight.grad().scalar_type(), at::kHalf);
    model->fc1->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
  }
  optimizer->step();
  EXPECT_TRUE(BitEqual(model->fc1->weight, before));
  EXPECT_EQ(loss_scale(), 32768.0);
}

// The fused step on the GPU: the host never waits while training, the
// outcome arrives without blocking, a skipped step changes nothing, and the
// values follow LibTorch's own step within the documented tolerance, step
// by step.
TEST_F(CudaTest, FusedStepSkipsOnTheDeviceWithoutHostSyncs) {
  for (OptLevel level : {O1, O2}) {
    SCOPED_TRACE(to_string(level));
    std::vector<std::vector<std::vector<at::Tensor>>> traces;  // [run][step]: parameters after it
    for (bool fused : {true, false}) {
      traces.emplace_back();
      torch::manual_seed(0);
      auto model = TinyNet();
      model->to(torch::kCUDA);
      OptimizerPtr optimizer;
      if (fused) optimizer = std::make_shared<amp::optim::FusedAdamW>(model->parameters(), 1e-2);
      if (!fused) optimizer = std::make_shared<torch::optim::AdamW>(model->parameters(), 1e-2);
      Options options = quiet(level);
      Handle handle;
      std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
      torch::manual_seed(1);
      const int64_t syncs = host_syncs();
      std::vector<at::Tensor> before_skip;
      for (int step = 0; step < 6; ++step) {
        optimizer->zero_grad();
        {
          scale_loss scaled(model->forward(torch::randn({16, 8}, torch::kCUDA)).to(at::kFloat).pow(2).mean(),
                            optimizer);
          scaled.backward();
          if (step == 3) model->fc2->bias.mutable_grad().fill_(std::numeric_limits<float>::infinity());
        }
        if (step == 3) {
          for (const auto& p : master_params(*optimizer)) before_skip.push_back(p.detach().clone());
        }
        optimizer->step();
        traces.back().push_back({});
        for (const auto& p : master_params(*optimizer)) traces.back().back().push_back(p.detach().clone());
        if (step == 3) {
          const auto after = master_params(*optimizer);
          for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(BitEqual(after[i], before_skip[i]));
        }
      }
      EXPECT_EQ(host_syncs() - syncs, fused ? 0 : 6);
      EXPECT_EQ(skipped_steps(*optimizer), 1);  // waits for the last outcome if needed
    }
    // The first two steps agree within float32 roundings (CUDA's fused
    // kernel computes Adam's bias corrections in float32, LibTorch's step in
    // double). From then on the float16 forward turns those last-bit
    // differences in the weights into float16 ulps of the next gradients, so
    // the runs drift apart slowly (6.6e-6 at most after six steps on an
    // H100); a wrongly counted or applied step would differ by about lr.
    for (size_t step = 0; step < traces[0].size(); ++step) {
      const double rtol = step < 2 ? 1e-5 : 1e-4, atol = step < 2 ? 1e-6 : 1e-5;
      for (size_t i = 0; i < traces[0][step].size(); ++i) {
        const auto& a = traces[0][step][i];
        const auto& b = traces[1][step][i];
        EXPECT_TRUE(torch::allclose(a, b, rtol, atol))
            << "step " << step << " parameter " << i << ": largest difference "
            << (a - b).abs().max().item<double>() << " of largest magnitude " << b.abs().max().item<double>();
      }
    }
  }
}

// O3 on the GPU: float16 weights stepped by the fused kernels (state in
// float16), skipping on the device without a host read. SGD stays within
// float16 roundings of LibTorch's own step. AdamW does not: LibTorch's step
// computes in float16, where (1 - beta2) * g^2 flushes to zero for small
// gradients, and the fused kernel in float32 (0.66 apart after 4 steps). Its
// values are checked against float64 arithmetic instead
// (FusedStepTest.OnCudaLowPrecisionAdamWIsFloat32ArithmeticRoundedOnce).
TEST_F(CudaTest, FusedStepStepsFloat16WeightsAtO3) {
  for (bool adam : {true, false}) {
    SCOPED_TRACE(adam ? "AdamW" : "SGD with momentum");
    std::vector<std::vector<at::Tensor>> finals;
    for (bool fused : {true, false}) {
      torch::manual_seed(0);
      auto model = TinyNet();
      model->to(torch::kCUDA);
      const auto adamw = torch::optim::AdamWOptions(1e-2).eps(1e-4);
      const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
      OptimizerPtr optimizer;
      if (adam && fused) optimizer = std::make_shared<amp::optim::FusedAdamW>(model->parameters(), adamw);
      if (adam && !fused) optimizer = std::make_shared<torch::optim::AdamW>(model->parameters(), adamw);
      if (!adam && fused) optimizer = std::make_shared<amp::optim::FusedSGD>(model->parameters(), sgd);
      if (!adam && !fused) optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), sgd);
      Options options = quiet(O3);
      options.loss_scale = LossScale::Dynamic();
      Handle handle;
      std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
      torch::manual_seed(1);
      const int64_t syncs = host_syncs();
      for (int step = 0; step < 4; ++step) {
        optimizer->zero_grad();
        {
          scale_loss scaled(model->forward(torch::randn({16, 8}, torch::kCUDA)).to(at::kFloat).pow(2).mean(),
                            optimizer);
          scaled.backward();
        }
        optimizer->step();
      }
      EXPECT_EQ(host_syncs() - syncs, fused ? 0 : 4);
      EXPECT_EQ(model->fc1->weight.scalar_type(), at::kHalf);
      std::vector<at::Tensor> params;
      for (const auto& p : model->parameters()) params.push_back(p.detach().to(at::kFloat).cpu());
      finals.push_back(params);
    }
    for (size_t i = 0; i < finals[0].size() && !adam; ++i) {
      EXPECT_TRUE(torch::allclose(finals[0][i], finals[1][i], 4e-3, 2e-3))
          << "parameter " << i << ": largest difference " << (finals[0][i] - finals[1][i]).abs().max().item<double>();
    }
  }
}

// Model parallel: gradients on two devices are checked where they live and
// folded into the one flag on the scale's device; an inf on either skips.
TEST_F(CudaTest, GradientsOnTwoDevicesFoldIntoOneVerdict) {
  for (c10::DeviceType inf_on : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
    SCOPED_TRACE(c10::DeviceTypeName(inf_on));
    internal::LossScaling scaler(LossScale::Dynamic(), DynamicScaling{});
    at::Tensor found_inf = torch::zeros({1}, torch::kCUDA);
    (void)scaler.scale_tensor(torch::kCUDA);
    auto on_cpu = torch::full({3}, 1024.0), on_cuda = torch::full({3}, 2048.0, torch::kCUDA);
    (inf_on == c10::DeviceType::CPU ? on_cpu : on_cuda)[1] = std::numeric_limits<float>::infinity();
    scaler.unscale({on_cpu, on_cuda}, found_inf);
    EXPECT_EQ(found_inf.item<float>(), 1.0f);
    EXPECT_EQ(on_cpu[0].item<float>(), 1024.0f / 65536.0f);
    EXPECT_EQ(on_cuda[0].item<float>(), 2048.0f / 65536.0f);
  }
  internal::LossScaling scaler(LossScale::Dynamic(), DynamicScaling{});
  at::Tensor found_inf = torch::zeros({1}, torch::kCUDA);
  (void)scaler.scale_tensor(torch::kCUDA);
  scaler.unscale({torch::ones({3}), torch::ones({3}, torch::kCUDA)}, found_inf);
  EXPECT_EQ(found_inf.item<float>(), 0.0f) << "clean on both devices";
}

}  // namespace
}  // namespace amp::testing
