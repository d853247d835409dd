// The CPU's low-precision arithmetic: what amp reports, what initialize says
// on a CPU that emulates the low dtype, and nn::LSTM at O1 running in float32
// where oneDNN has no low-precision RNN instead of failing. Both kinds of CPU
// are forced through set_cpu_precision_for_testing, so the suite covers them
// on whichever machine it runs.
#include "test_util.h"

#include <ATen/cpu/Utils.h>

namespace amp::testing {
namespace {

CpuPrecision emulating_cpu() {
  CpuPrecision cpu;
  cpu.name = "Test AVX2 CPU";
  return cpu;
}

CpuPrecision native_cpu() {
  CpuPrecision cpu;
  cpu.name = "Test AMX CPU";
  cpu.bf16_arithmetic = cpu.fp16_arithmetic = cpu.onednn_bf16 = cpu.onednn_fp16 = true;
  return cpu;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

class HardwareTest : public AmpTest {
 protected:
  void TearDown() override {
    set_cpu_precision_for_testing(std::nullopt);
    AmpTest::TearDown();
  }
  // What amp::initialize prints for a TinyNet at `options`.
  static std::string initialize_output(Options options) {
    auto model = TinyNet();
    OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
    ::testing::internal::CaptureStderr();
    Handle handle;
    handle.initialize(model, optimizer, options);
    return ::testing::internal::GetCapturedStderr();
  }
};

TEST_F(HardwareTest, ReportsWhatAtenDetects) {
  const CpuPrecision cpu = cpu_precision();
  const auto caps = at::cpu::get_cpu_capabilities();
  EXPECT_EQ(cpu.name, caps.at("cpu_name").toStringRef());
  EXPECT_EQ(cpu.bf16_arithmetic, caps.at("avx512_bf16").toBool() || caps.at("amx_bf16").toBool());
  EXPECT_EQ(cpu.fp16_arithmetic, caps.at("avx512_fp16").toBool() || caps.at("amx_fp16").toBool());
  EXPECT_EQ(cpu.runs_natively(at::kBFloat16), cpu.bf16_arithmetic);
  EXPECT_TRUE(cpu.runs_natively(at::kFloat));
  EXPECT_EQ(describe(cpu, at::kBFloat16).empty(), cpu.bf16_arithmetic);
  EXPECT_TRUE(describe(cpu, at::kFloat).empty());
  std::cout << "[ cpu      ] " << cpu.name << ": bf16 arithmetic " << cpu.bf16_arithmetic << ", fp16 arithmetic "
            << cpu.fp16_arithmetic << ", oneDNN bf16 " << cpu.onednn_bf16 << ", oneDNN fp16 " << cpu.onednn_fp16 << "\n";
}

TEST_F(HardwareTest, InitializeSaysOnceWhenTheCpuEmulatesTheLowDtype) {
  set_cpu_precision_for_testing(emulating_cpu());
  for (OptLevel level : {O1, O2, O3, O4, O5}) {
    const std::string out = initialize_output(level);
    EXPECT_EQ(count(out, "note: this CPU (Test AVX2 CPU) has no BFloat16 arithmetic"), 1) << out;
    EXPECT_EQ(count(out, "opt_level O0 for speed"), 1) << out;
  }
  Options fp16 = O1;
  fp16.cpu_dtype = at::kHalf;
  EXPECT_EQ(count(initialize_output(fp16), "has no Half arithmetic (AVX-512-FP16 or AMX-FP16)"), 1);
  EXPECT_EQ(count(initialize_output(O0), "note:"), 0) << "O0 computes in float32";
  EXPECT_EQ(initialize_output(quiet(O1)), "") << "verbosity 0 is silent";
  set_cpu_precision_for_testing(native_cpu());
  EXPECT_EQ(count(initialize_output(O1), "note:"), 0) << "nothing to say on a CPU with bf16 arithmetic";
}

// Plain fp32 LibTorch LSTM outputs for `x`, and a copy of `lstm` for amp.
std::pair<at::Tensor, torch::nn::LSTM> reference_lstm(const at::Tensor& x) {
  torch::manual_seed(0);
  torch::nn::LSTM lstm(8, 16);
  const at::Tensor want = std::get<0>(lstm->forward(x)).detach();
  return {want, lstm};
}

TEST_F(HardwareTest, LstmAtO1RunsInFloat32WhereOneDnnHasNoLowPrecisionRnn) {
  set_cpu_precision_for_testing(emulating_cpu());
  const auto x = torch::randn({5, 3, 8});
  auto [want, lstm] = reference_lstm(x);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(lstm->parameters(), 0.1);
  Handle handle;
  std::tie(lstm, optimizer) = handle.initialize(lstm, optimizer, quiet(O1));
  const auto out = std::get<0>(lstm->forward(x));
  EXPECT_TRUE(BitEqual(out, want)) << "float32, exactly as without amp";
  {
    scale_loss scaled(out.pow(2).mean(), optimizer);
    scaled.backward();
  }
  optimizer->step();
  EXPECT_FALSE(last_step_skipped(*optimizer));
  for (const auto& p : lstm->parameters()) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
}

TEST_F(HardwareTest, LstmAtO1UsesOneDnnLowPrecisionWhereTheCpuHasIt) {
  const bool really = cpu_precision().onednn_bf16;
  set_cpu_precision_for_testing(native_cpu());  // amp binds the row in bfloat16
  const auto x = torch::randn({5, 3, 8});
  auto [want, lstm] = reference_lstm(x);
  Handle handle;
  lstm = handle.initialize(lstm, quiet(O1));
  OpStatsRecorder recorder;
  if (!really) {  // what native autocast does on this CPU too
    EXPECT_THAT([&] { lstm->forward(x); },
                ::testing::ThrowsMessage<std::exception>(::testing::HasSubstr("could not create a primitive")));
    return;
  }
  const auto out = std::get<0>(lstm->forward(x));
  EXPECT_TRUE(torch::allclose(out.to(at::kFloat), want, 5e-2, 5e-2));
  bool seen = false;
  for (const auto& row : recorder.stats()) {
    if (row.op != "aten::mkldnn_rnn_layer") continue;
    seen = true;
    EXPECT_EQ(row.policy, CastPolicy::kLowerPrecision);
    EXPECT_GT(row.casts, 0);
  }
  EXPECT_TRUE(seen);
}

}  // namespace
}  // namespace amp::testing
