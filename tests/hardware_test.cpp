// SPDX-License-Identifier: BSD-3-Clause
// The CPU's low-precision arithmetic: what amp reports, what initialize says
// on a CPU that emulates the low dtype, and nn::LSTM at O1 running in float32
// where oneDNN has no low-precision RNN instead of failing. Both kinds of CPU
// are forced through set_cpu_precision_for_testing, so the suite covers them
// on whichever machine it runs.
#include "test_util.h"

#include <ATen/cpu/Utils.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

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

class HardwareTest : public AmpTest {
 protected:
  void TearDown() override {
    set_cpu_precision_for_testing(std::nullopt);
    AmpTest::TearDown();
  }
  // The notes amp::initialize gives for a TinyNet at `options`.
  static std::vector<LogEvent> initialize_notes(Options options) {
    options.keep_cpu_memory = false;  // its note comes once a process, at whichever test is first
    auto model = TinyNet();
    OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
    LogRecorder log;
    Handle handle;
    handle.initialize(model, optimizer, options);
    std::vector<LogEvent> notes;
    for (const LogEvent& e : log.take()) {
      if (e.kind == LogEvent::Kind::kNote) notes.push_back(e);
    }
    return notes;
  }
};

// The decision for CPUs of known capabilities (ATen's flag names).
TEST_F(HardwareTest, DecidesFromTheCapabilitiesOfKnownCpus) {
  struct Row {
    const char* cpu;
    std::set<std::string> flags;
    bool bf16, fp16, onednn_bf16, onednn_fp16;
  };
  const std::set<std::string> avx512_core{"avx2", "avx512_bw", "avx512_vl", "avx512_dq"};
  auto with = [&](std::set<std::string> more) {
    more.insert(avx512_core.begin(), avx512_core.end());
    return more;
  };
  const std::vector<Row> rows = {
      {"AVX2 only (Zen 3 EPYC, most laptops)", {"avx2"}, false, false, false, false},
      {"AVX-512 without BF16 (Skylake-SP)", avx512_core, false, false, true, false},
      {"Zen 4 EPYC", with({"avx512_bf16", "avx512_vnni"}), true, false, true, false},
      {"Cooper Lake", with({"avx512_bf16"}), true, false, true, false},
      {"Sapphire Rapids", with({"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}), true, true, true, true},
      {"Granite Rapids", with({"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"}), true, true, true, true},
      {"AVX-NE-CONVERT without AVX-512 (Sierra Forest)", {"avx2", "avx_ne_convert"}, false, false, true, true},
  };
  for (const Row& row : rows) {
    const CpuPrecision cpu = cpu_precision_from(row.cpu, row.flags);
    EXPECT_EQ(cpu.name, row.cpu);
    EXPECT_EQ(cpu.bf16_arithmetic, row.bf16) << row.cpu;
    EXPECT_EQ(cpu.fp16_arithmetic, row.fp16) << row.cpu;
    EXPECT_EQ(cpu.onednn_bf16, row.onednn_bf16) << row.cpu;
    EXPECT_EQ(cpu.onednn_fp16, row.onednn_fp16) << row.cpu;
    EXPECT_EQ(cpu.runs_natively(at::kBFloat16), row.bf16) << row.cpu;
    EXPECT_EQ(cpu.runs_natively(at::kHalf), row.fp16) << row.cpu;
    EXPECT_TRUE(cpu.runs_natively(at::kFloat));
    EXPECT_EQ(describe(cpu, at::kBFloat16).empty(), row.bf16) << row.cpu;
  }
  // oneDNN capped by ONEDNN_MAX_CPU_ISA: a Sapphire Rapids uses only the
  // instructions below the cap (names in any case; an unknown one caps nothing).
  const std::set<std::string> sapphire_rapids = with({"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"});
  struct Cap {
    const char* isa;
    bool bf16, fp16, onednn_bf16, onednn_fp16;
  };
  for (const Cap& cap : std::vector<Cap>{{"AVX2", false, false, false, false},
                                         {"avx512_core", false, false, true, false},
                                         {"AVX512_CORE_BF16", true, false, true, false},
                                         {"AVX512_CORE_FP16", true, true, true, true},
                                         {"AVX512_CORE_AMX", true, true, true, true},
                                         {"ALL", true, true, true, true},
                                         {"NO_SUCH_ISA", true, true, true, true}}) {
    const CpuPrecision cpu = cpu_precision_from("Sapphire Rapids", sapphire_rapids, cap.isa);
    EXPECT_EQ(cpu.bf16_arithmetic, cap.bf16) << cap.isa;
    EXPECT_EQ(cpu.fp16_arithmetic, cap.fp16) << cap.isa;
    EXPECT_EQ(cpu.onednn_bf16, cap.onednn_bf16) << cap.isa;
    EXPECT_EQ(cpu.onednn_fp16, cap.onednn_fp16) << cap.isa;
  }
}

// The kernel's own account of this CPU: the flags of its first processor in
// /proc/cpuinfo (empty where there is none).
std::set<std::string> proc_cpuinfo_flags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    return {std::istream_iterator<std::string>(words), std::istream_iterator<std::string>()};
  }
  return {};
}

TEST_F(HardwareTest, ReportsThisMachineAsItsKernelDoes) {
  const CpuPrecision cpu = cpu_precision();
  std::cout << "[ cpu      ] " << cpu.name << ": bf16 arithmetic " << cpu.bf16_arithmetic << ", fp16 arithmetic "
            << cpu.fp16_arithmetic << ", oneDNN bf16 " << cpu.onednn_bf16 << ", oneDNN fp16 " << cpu.onednn_fp16 << "\n";
  EXPECT_TRUE(describe(cpu, at::kFloat).empty());
  const std::set<std::string> flags = proc_cpuinfo_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this machine to compare with";
  if (const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA"); cap && std::string(cap) != "ALL") {
    const std::string isa = cap;
    if (isa != "SSE41" && isa != "AVX" && isa != "AVX2") {
      GTEST_SKIP() << "ONEDNN_MAX_CPU_ISA=" << isa << " caps oneDNN below this CPU; DecidesFromTheCapabilitiesOfKnownCpus covers caps";
    }
    EXPECT_FALSE(cpu.bf16_arithmetic || cpu.fp16_arithmetic || cpu.onednn_bf16 || cpu.onednn_fp16)
        << "ONEDNN_MAX_CPU_ISA=" << isa << ": oneDNN has no low-precision arithmetic or primitives";
    return;
  }
  auto has = [&](const char* flag) { return flags.count(flag) != 0; };
  EXPECT_EQ(cpu.bf16_arithmetic, has("avx512_bf16") || has("amx_bf16"));
  EXPECT_EQ(cpu.fp16_arithmetic, has("avx512_fp16") || has("amx_fp16"));
  EXPECT_EQ(cpu.onednn_bf16, (has("avx512bw") && has("avx512vl") && has("avx512dq")) || has("avx_ne_convert"));
  EXPECT_EQ(describe(cpu, at::kBFloat16).empty(), cpu.bf16_arithmetic) << "a note exactly where bf16 is emulated";
}

TEST_F(HardwareTest, InitializeSaysOnceWhenTheCpuEmulatesTheLowDtype) {
  set_cpu_precision_for_testing(emulating_cpu());
  for (OptLevel level : {O1, O2, O3, O4, O5}) {
    const auto notes = initialize_notes(level);
    ASSERT_EQ(notes.size(), 1u) << to_string(level);
    EXPECT_EQ(notes[0].code, "cpu_emulates_dtype");
    EXPECT_EQ(notes[0].message, describe(emulating_cpu(), at::kBFloat16));
  }
  Options fp16 = O1;
  fp16.cpu_dtype = at::kHalf;
  const auto notes = initialize_notes(fp16);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].message, describe(emulating_cpu(), at::kHalf));
  EXPECT_TRUE(initialize_notes(O0).empty()) << "O0 computes in float32";
  EXPECT_TRUE(initialize_notes(quiet(O1)).empty()) << "verbosity 0 is silent";
  set_cpu_precision_for_testing(native_cpu());
  EXPECT_TRUE(initialize_notes(O1).empty()) << "nothing to say on a CPU with bf16 arithmetic";
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
