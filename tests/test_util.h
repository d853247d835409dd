// SPDX-License-Identifier: BSD-3-Clause
// Shared helpers for amp's tests.
#pragma once

#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>
#include <amp/internal/level_rules.h>
#include <amp/internal/loss_scaling.h>
#include <amp/testing.h>

#include "fp8/fp8_linear.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <ATen/cuda/CUDAGraph.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <algorithm>
#include <limits>
#include <mutex>
#include <sstream>
#include <optional>
#include <string>

// Expects `statement` to throw a c10::Error whose message contains `substring`.
#define EXPECT_AMP_ERROR(statement, substring)                          \
  EXPECT_THAT([&] { statement; }, ::testing::ThrowsMessage<c10::Error>( \
                                      ::testing::HasSubstr(substring)))

namespace amp::testing {

using ModulePtr = std::shared_ptr<torch::nn::Module>;
using OptimizerPtr = std::shared_ptr<torch::optim::Optimizer>;

// The current scale of loss `loss_id` (reads the device).
inline double loss_scale(int loss_id = 0) { return amp::loss_scaler(loss_id)->scale(); }

// A guard's verdict on the live scaler's CPU scale that says overflow (for
// internal::LossScaling::update).
inline at::Tensor overflowed_verdict(int loss_id = 0) {
  at::Tensor verdict = internal::live_scaling(loss_id).new_verdict(c10::kCPU);
  internal::LossScaling::overflow_flag(verdict).fill_(1);
  return verdict;
}

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kE4m3Max = 448.0;  // float8 e4m3's largest finite value

// Exact equality: same dtype, shape and every bit of every value.
inline ::testing::AssertionResult BitEqual(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type()) {
    return ::testing::AssertionFailure() << "dtypes differ: " << a.scalar_type() << " vs "
                                         << b.scalar_type();
  }
  if (a.sizes() != b.sizes()) {
    return ::testing::AssertionFailure() << "shapes differ: " << a.sizes() << " vs " << b.sizes();
  }
  const at::Tensor x = a.detach().cpu().contiguous(), y = b.detach().cpu().contiguous();
  if (std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) {
    return ::testing::AssertionFailure() << "values differ, max |a-b| = "
                                         << (x.to(at::kDouble) - y.to(at::kDouble)).abs().max().item<double>();
  }
  return ::testing::AssertionSuccess();
}

// Each tensor of `a` bit for bit its partner in `b` (`what` names them).
inline void expect_bit_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(BitEqual(a[i], b[i])) << what << " " << i;
}

// Each tensor bit for bit its partner (BitEqual), the same count.
inline ::testing::AssertionResult AllBitEqual(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " vs " << b.size() << " tensors";
  for (size_t i = 0; i < a.size(); ++i) {
    if (auto r = BitEqual(a[i], b[i]); !r) return r << " (tensor " << i << ")";
  }
  return ::testing::AssertionSuccess();
}

// Each tensor within rtol/atol of its partner (compared in float64 on the
// CPU), with the same shape and dtype.
inline ::testing::AssertionResult AllClose(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                                           double rtol, double atol) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " vs " << b.size() << " tensors";
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].sizes() != b[i].sizes() || a[i].scalar_type() != b[i].scalar_type()) {
      return ::testing::AssertionFailure() << "tensor " << i << " differs in shape or dtype";
    }
    const at::Tensor x = a[i].detach().cpu().to(at::kDouble), y = b[i].detach().cpu().to(at::kDouble);
    if (!torch::allclose(x, y, rtol, atol)) {
      return ::testing::AssertionFailure() << "tensor " << i << ": max |a-b| = " << (x - y).abs().max().item<double>();
    }
  }
  return ::testing::AssertionSuccess();
}

// Detached copies, to compare against after training moves on.
inline std::vector<at::Tensor> clones(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

// The optimizer's state as tensors, in parameter order: SGD momentum buffers,
// Adam's and AdamW's step counts and moments (amsgrad's maximum where
// kept), RMSprop's and Adagrad's, as kept (8-bit state packed). Comparable across optimizer
// instances (serialized bytes are not: they name state by tensor address).
inline std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> out;
  auto adam_like = [&out](const auto& s) {
    out.insert(out.end(), {torch::tensor(s.step()), s.exp_avg(), s.exp_avg_sq()});
    if (s.max_exp_avg_sq().defined()) out.push_back(s.max_exp_avg_sq());
  };
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      const torch::optim::OptimizerParamState* s = it->second.get();
      if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
        out.push_back(sgd->momentum_buffer());
      } else if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
        adam_like(*adam);
      } else if (auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
        adam_like(*adamw);
      } else if (auto* rms = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
        out.insert(out.end(), {torch::tensor(rms->step()), rms->square_avg()});
        for (const at::Tensor& t : {rms->momentum_buffer(), rms->grad_avg()}) {
          if (t.defined()) out.push_back(t);
        }
      } else if (auto* adagrad = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
        out.insert(out.end(), {torch::tensor(adagrad->step()), adagrad->sum()});
      } else {
        ADD_FAILURE() << "optimizer_state_tensors: unsupported optimizer state type";
      }
    }
  }
  return out;
}

// A path in the temp directory, unique to this process (tests run in
// parallel under ctest).
inline std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("amp_test_" + std::to_string(getpid()) + "_" + name)).string();
}

// Records amp's log events while it lives (amp/log.h), instead of printing.
class LogRecorder {
 public:
  LogRecorder()
      : previous_(set_log_sink([this](const LogEvent& e) {
          std::lock_guard<std::mutex> lock(mutex_);
          events_.push_back(e);
        })) {}
  ~LogRecorder() { set_log_sink(previous_); }
  LogRecorder(const LogRecorder&) = delete;
  LogRecorder& operator=(const LogRecorder&) = delete;

  std::vector<LogEvent> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(events_, {});
  }
  // How many events of `kind` (and `code`, if given) arrived so far.
  int count(LogEvent::Kind kind, const std::string& code = "") {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int>(std::count_if(events_.begin(), events_.end(), [&](const LogEvent& e) {
      return e.kind == kind && (code.empty() || e.code == code);
    }));
  }

 private:
  std::mutex mutex_;
  std::vector<LogEvent> events_;
  LogSink previous_;
};

// Records LibTorch's warnings (TORCH_WARN) on this thread while it lives.
class WarningRecorder final : public c10::WarningHandler {
 public:
  WarningRecorder() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~WarningRecorder() override { c10::WarningUtils::set_warning_handler(previous_); }
  WarningRecorder(const WarningRecorder&) = delete;
  WarningRecorder& operator=(const WarningRecorder&) = delete;

  void process(const c10::Warning& warning) override { messages_.push_back(warning.msg()); }
  const std::vector<std::string>& messages() const { return messages_; }

 private:
  c10::WarningHandler* previous_;
  std::vector<std::string> messages_;
};

// Loads amp's state from the bytes of a saved archive.
inline void load_state_bytes(const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  load_state(archive);
}

// Deinitializes amp and drops user registrations after every test, so tests
// are independent even when one fails half-way. (A fixture's Handle ends
// its own initialization when the fixture is destroyed, before the next.)
// An opt level, and for its float16 variants the CPU's low dtype: the
// parameter of tests that run at every level.
struct LevelCase {
  std::string name;
  amp::OptLevel level;
  std::optional<c10::ScalarType> cpu_dtype;
  // The level's options with the case's CPU dtype.
  amp::Options options() const {
    amp::Options o = level;
    o.cpu_dtype = cpu_dtype;
    return o;
  }
};
inline void PrintTo(const LevelCase& c, std::ostream* os) { *os << c.name; }

// O0-O6, and O1-O3 in float16, as test parameters named by the level.
inline auto every_level() {
  return ::testing::Values(LevelCase{"O0", amp::O0, std::nullopt}, LevelCase{"O1", amp::O1, std::nullopt},
                           LevelCase{"O2", amp::O2, std::nullopt}, LevelCase{"O3", amp::O3, std::nullopt},
                           LevelCase{"O4", amp::O4, std::nullopt}, LevelCase{"O5", amp::O5, std::nullopt},
                           LevelCase{"O6", amp::O6, std::nullopt}, LevelCase{"O1_fp16", amp::O1, c10::kHalf},
                           LevelCase{"O2_fp16", amp::O2, c10::kHalf}, LevelCase{"O3_fp16", amp::O3, c10::kHalf});
}
inline std::string level_case_name(const ::testing::TestParamInfo<LevelCase>& info) { return info.param.name; }

class AmpTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (amp::is_initialized()) amp::deinitialize();
    amp::reset_user_registrations();
  }
  static amp::Options quiet(amp::Options options) {
    options.verbosity = 0;
    return options;
  }
};

// Identity forward; its backward turns the gradient into inf (overflow
// provenance's injection inside backward).
struct InfInBackward : torch::autograd::Function<InfInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0] * std::numeric_limits<float>::infinity()};
  }
};

// Two linear layers and a ReLU: enough for casts, caches and steps.
struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl(int64_t in = 8, int64_t hidden = 16, int64_t out = 4)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(TinyNet);

// Why a float8 CUDA test cannot run here ("" where it can: a CUDA device
// whose _scaled_mm takes float8, compute capability 8.9+).
inline std::string no_cuda_float8() {
  if (!torch::cuda::is_available()) return "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  const std::string missing = detail::float8_unavailable(torch::kCUDA);
  return missing.empty() ? "" : "this GPU has no float8 GEMM kernel (compute capability 8.9+): " + missing;
}

// O5 with the fp8 property, quiet.
inline Options fp8_options() {
  Options options = O5;
  options.fp8 = true;
  options.verbosity = 0;
  return options;
}

// The float8 calls and fallbacks `recorder` saw, over every op.
inline std::pair<int64_t, int64_t> float8_calls(const OpStatsRecorder& recorder) {
  int64_t float8 = 0, fallbacks = 0;
  for (const OpStats& row : recorder.stats()) float8 += row.float8, fallbacks += row.float8_fallbacks;
  return {float8, fallbacks};
}

// Steps `first`..`last`-1 of a CUDA training run, each after feed(step):
// run eagerly, or as replays of one capture of step() (on a side stream,
// after the warm-up steps a capture needs).
inline void eager_or_replayed(bool graphed, int first, int last, const std::function<void(int)>& feed,
                              const std::function<void()>& step) {
  at::cuda::CUDAGraph graph;
  if (graphed) {
    graph.capture_begin();
    step();
    graph.capture_end();
  }
  for (int s = first; s < last; ++s) {
    feed(s);
    graphed ? graph.replay() : step();
  }
}

}  // namespace amp::testing
