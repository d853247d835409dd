// SPDX-License-Identifier: BSD-3-Clause
// amp's loss scaling against a real peer: PyTorch's own torch.amp (autocast
// + GradScaler), run by the project's .venv Python (tests/peer/
// grad_scaler_peer.py) on the same model, data and injected inf/NaN
// gradients. amp at O1 must give the same loss scale after every step, the
// same skipped steps and bit-identical parameters, with SGD (momentum) and
// with Adam: LibTorch's own step against GradScaler.step, and amp's fused
// step against torch.amp's fused optimizers (SGD, Adam, AdamW with amsgrad),
// where both skip on the device.
#include "test_util.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include <unistd.h>

namespace amp::testing {
namespace {

constexpr int kPeerSteps = 24;
constexpr double kInitScale = 1024;
constexpr int kGrowthInterval = 3;
const std::vector<std::pair<int, float>>& faults() {
  static const std::vector<std::pair<int, float>> f = {{2, std::numeric_limits<float>::infinity()},
                                                        {9, std::numeric_limits<float>::quiet_NaN()},
                                                        {10, std::numeric_limits<float>::infinity()},
                                                        {17, -std::numeric_limits<float>::infinity()}};
  return f;
}

void write_raw(const std::string& path, const at::Tensor& t) {
  const at::Tensor c = t.to(at::kFloat).contiguous();
  std::ofstream(path, std::ios::binary).write(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

at::Tensor read_raw(const std::string& path, int64_t n) {
  at::Tensor t = torch::empty({n}, torch::kFloat);
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(t.data_ptr()), t.nbytes());
  EXPECT_EQ(in.gcount(), static_cast<std::streamsize>(t.nbytes())) << path;
  return t;
}

struct PeerModelImpl : torch::nn::Module {
  explicit PeerModelImpl(const std::vector<at::Tensor>& init)
      : w1(register_parameter("w1", init[0].clone())),
        b1(register_parameter("b1", init[1].clone())),
        w2(register_parameter("w2", init[2].clone())),
        b2(register_parameter("b2", init[3].clone())) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::linear(torch::relu(torch::linear(x, w1, b1)), w2, b2);
  }
  torch::Tensor w1, b1, w2, b2;
};
TORCH_MODULE(PeerModel);

const std::vector<std::string>& peer_optimizers() {
  static const std::vector<std::string> names = {"sgd", "adam", "sgd_fused", "adam_fused", "adamw_fused"};
  return names;
}

// The start and the data every optimizer's run shares.
struct PeerInputs {
  std::vector<at::Tensor> init;
  at::Tensor x, t;
};
PeerInputs peer_inputs() {
  torch::manual_seed(7);
  PeerInputs in;
  in.init = {torch::randn({16, 8}) * 0.3, torch::randn({16}) * 0.1, torch::randn({4, 16}) * 0.3,
             torch::randn({4}) * 0.1};
  in.x = torch::randn({kPeerSteps, 32, 8});
  in.t = torch::randn({kPeerSteps, 32, 4});
  return in;
}

// The peer runs once for the suite, every optimizer in one Python process
// (importing torch is most of a run); each test compares with its own.
class GradScalerPeerTest : public AmpTest, public ::testing::WithParamInterface<std::string> {
 protected:
  static void SetUpTestSuite() {
    if (std::system((std::string(AMP_PEER_PYTHON) + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
      skip_why_ = std::string("no Python with torch at ") + AMP_PEER_PYTHON +
                  " (tools/setup.sh installs it into .venv); the peer comparison needs it";
      return;
    }
    char dir[] = "/tmp/amp_peer_XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    const PeerInputs in = peer_inputs();
    for (auto [name, tensor] : {std::pair{"w1", in.init[0]}, {"b1", in.init[1]}, {"w2", in.init[2]},
                                {"b2", in.init[3]}, {"x", in.x}, {"t", in.t}}) {
      write_raw(dir_ + "/" + name, tensor);
    }
    std::ostringstream fault_list, names;
    for (const auto& [step, value] : faults()) {
      fault_list << (fault_list.tellp() > 0 ? "," : "") << step << ":" << value;
    }
    for (const std::string& name : peer_optimizers()) names << (names.tellp() > 0 ? "," : "") << name;
    std::ostringstream command;
    command << AMP_PEER_PYTHON << " -W ignore " << AMP_PEER_SCRIPT << " " << dir_ << " " << names.str() << " "
            << kPeerSteps << " " << kInitScale << " " << kGrowthInterval << " " << fault_list.str();
    peer_status_ = std::system(command.str().c_str());
    peer_command_ = command.str();
  }
  static void TearDownTestSuite() {
    if (dir_.empty()) return;
    for (const char* name : {"w1", "b1", "w2", "b2", "x", "t"}) std::remove((dir_ + "/" + name).c_str());
    for (const std::string& optimizer : peer_optimizers()) {
      for (const char* what : {"peer_scales_", "peer_skipped_", "peer_params_"}) {
        std::remove((dir_ + "/" + what + optimizer).c_str());
      }
    }
    rmdir(dir_.c_str());
    dir_.clear();
  }
  void SetUp() override {
    if (!skip_why_.empty()) GTEST_SKIP() << skip_why_;
    ASSERT_EQ(peer_status_, 0) << peer_command_;
    threads_ = at::get_num_threads();
    at::set_num_threads(1);  // the peer runs single-threaded too: same reduction order
  }
  void TearDown() override {
    at::set_num_threads(threads_);
    AmpTest::TearDown();
  }
  // The peer's output `what` ("peer_scales") for this test's optimizer.
  static at::Tensor peer(const std::string& what, int64_t n) { return read_raw(dir_ + "/" + what + "_" + GetParam(), n); }

  static inline std::string dir_, skip_why_, peer_command_;
  static inline int peer_status_ = -1;
  int threads_ = 1;
};

TEST_P(GradScalerPeerTest, ScalesSkipsAndParametersEqualTorchAmpBitForBit) {
  const std::string optimizer_name = GetParam();
  const PeerInputs in = peer_inputs();
  const std::vector<at::Tensor>& init = in.init;
  const at::Tensor &x = in.x, &t = in.t;

  PeerModel model(init);
  OptimizerPtr optimizer;
  const bool fused = optimizer_name.find("_fused") != std::string::npos;
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.05).amsgrad(true);
  if (optimizer_name == "sgd") {
    optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), sgd);
  } else if (optimizer_name == "sgd_fused") {
    optimizer = std::make_shared<amp::optim::FusedSGD>(model->parameters(), sgd);
  } else if (optimizer_name == "adamw_fused") {
    optimizer = std::make_shared<amp::optim::FusedAdamW>(model->parameters(), adamw);
  } else if (fused) {
    optimizer = std::make_shared<amp::optim::FusedAdam>(model->parameters(), 1e-2);
  } else {
    optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-2);
  }
  Options options = quiet(O1);
  options.loss_scale = LossScale::Dynamic(kInitScale);
  options.dynamic_scaling.growth_interval = kGrowthInterval;
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  std::vector<float> scales, skipped;
  for (int step = 0; step < kPeerSteps; ++step) {
    optimizer->zero_grad();
    const auto loss = (model->forward(x[step]).to(at::kFloat) - t[step]).pow(2).mean();
    {
      scale_loss scaled(loss, optimizer);
      scaled.backward();
      for (const auto& [fault_step, value] : faults()) {
        if (fault_step == step) model->w1.grad()[0][0].fill_(value);
      }
    }
    optimizer->step();
    scales.push_back(static_cast<float>(loss_scale()));
    skipped.push_back(last_step_skipped(*optimizer) ? 1.0f : 0.0f);
  }

  EXPECT_TRUE(BitEqual(torch::tensor(scales), peer("peer_scales", kPeerSteps)))
      << "amp's scales " << torch::tensor(scales) << "\ntorch.amp's " << peer("peer_scales", kPeerSteps);
  EXPECT_TRUE(BitEqual(torch::tensor(skipped), peer("peer_skipped", kPeerSteps)));
  EXPECT_EQ(torch::tensor(skipped).sum().item<float>(), 4.0f) << "every injected fault skips its step";
  std::vector<at::Tensor> flat;
  for (const auto& p : model->parameters()) flat.push_back(p.detach().flatten());
  const auto params = torch::cat(flat);
  EXPECT_TRUE(BitEqual(params, peer("peer_params", params.numel())));
}

INSTANTIATE_TEST_SUITE_P(Optimizers, GradScalerPeerTest, ::testing::ValuesIn(peer_optimizers()));

}  // namespace
}  // namespace amp::testing
