// SPDX-License-Identifier: BSD-3-Clause
// Instructions per call of the dispatch cases of cpu_benchmarks' section 1,
// counted by valgrind's callgrind: plain LibTorch, native autocast and amp O1
// on the same calls, amp O1 with overflow provenance on (gradients
// enabled, as it watches forward ops only then), and amp O2 over a model
// whose weights a forward has lowered (what views and indexed reads of
// tensors that are not weights pay for amp watching them). Counts do not move with the load of a shared machine, so
// they settle differences of a few percent that timings there cannot. Each
// (case, mode) is one callgrind dump; tools/bench/dispatch_instructions.sh
// runs this under valgrind and prints the table.
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>
#include <amp/measured_policy.h>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <valgrind/callgrind.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int kCalls = 2000;

struct OpCase {
  std::string name;
  std::function<void()> call;
};

// The measured policy's table for the cases' GEMMs: bfloat16 kept.
void keep_bfloat16_for_the_gemms() {
  const std::string path = (std::filesystem::temp_directory_path() / "amp_dispatch_instructions_policy.txt").string();
  {
    std::ofstream file(path);
    for (const char* shapes : {"[4, 4] Float, [4, 4] Float", "[4, 4] BFloat16, [4, 4] BFloat16"}) {
      file << "aten::mm\t0\t" << shapes << "\tBFloat16\t1\t1\t0\n";
    }
    file << "aten::linear\t0\t[4, 4] Float, [4, 4] Float, [4] Float\tBFloat16\t1\t1\t0\n";
  }
  amp::load_measured_policy(path);
  std::remove(path.c_str());
}

}  // namespace

int main() {
  if (!RUNNING_ON_VALGRIND) {
    std::fprintf(stderr, "run me through tools/bench/dispatch_instructions.sh (valgrind --tool=callgrind)\n");
    return 2;
  }
  at::set_num_threads(1);
  const auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  const auto a_low = a.to(at::kBFloat16), b_low = b.to(at::kBFloat16);
  const auto weight = torch::randn({4, 4}, torch::requires_grad()), bias = torch::randn({4}, torch::requires_grad());
  const auto rows = torch::tensor({2, 0}, at::kLong);
  torch::NoGradGuard no_grad;  // dispatch, not graph building, as in cpu_benchmarks
  const std::vector<OpCase> cases = {
      {"mm fp32 (casts)", [&] { at::mm(a, b); }},
      {"mm bf16 (no cast)", [&] { at::mm(a_low, b_low); }},
      {"linear, cached weight", [&] { at::linear(a, weight, bias); }},
      {"cat bf16+fp32", [&] { at::cat({a_low, b}); }},
      {"relu (not intercepted)", [&] { at::relu(a); }},
      {"view", [&] { a.view({16}); }},
      {"narrow", [&] { a.narrow(/*dim=*/0, /*start=*/1, /*length=*/2); }},
      {"t", [&] { a.t(); }},
      {"index_select", [&] { a.index_select(/*dim=*/0, rows); }},
  };
  const char* modes[] = {"plain", "native", "amp", "provenance", "policy", "o2"};
  torch::nn::Linear model(4, 4);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  for (int mode = 0; mode < 6; ++mode) {
    std::unique_ptr<amp::Handle> handle;
    std::optional<torch::AutoGradMode> grad_mode;
    if (mode == 1) at::autocast::set_autocast_enabled(at::kCPU, true);
    if (mode >= 2) {
      amp::Options options = mode == 5 ? amp::O2 : amp::O1;
      options.verbosity = 0;
      options.keep_cpu_memory = false;  // glibc's heap as the plain and native modes had it
      options.overflow_provenance = mode == 3;
      options.measured_policy = mode == 4;
      if (mode == 3) grad_mode.emplace(true);
      if (mode == 4) keep_bfloat16_for_the_gemms();
      handle = std::make_unique<amp::Handle>();
      if (mode == 5) {
        handle->initialize(model, optimizer, options);
        torch::AutoGradMode grad(true);
        model(a);  // the forward's first op lowers the weights
      } else {
        handle->initialize(std::vector<std::shared_ptr<torch::nn::Module>>{}, {}, options);
      }
    }
    for (const OpCase& c : cases) {
      c.call();  // warm: caches filled, kernels looked up
      CALLGRIND_ZERO_STATS;
      for (int i = 0; i < kCalls; ++i) c.call();
      const std::string label = std::string(modes[mode]) + "|" + c.name + "|" + std::to_string(kCalls);
      CALLGRIND_DUMP_STATS_AT(label.c_str());
    }
    if (mode == 1) at::autocast::set_autocast_enabled(at::kCPU, false);
  }
  return 0;
}
