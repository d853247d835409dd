// SPDX-License-Identifier: BSD-3-Clause
// The host's cost of a whole training step - zero_grad, forward, the loss,
// backward under the loss scale, the step - counted in instructions by
// valgrind's callgrind, on tensors so small that the kernels' own work is
// a small part and what is counted is what the host spends around them:
// LibTorch in float32, LibTorch's native autocast with the loss-scaling
// loop the tutorials write (in C++: scale, backward, unscale and check,
// step unless not finite, update the scale), and amp at O1, O2, O5 (with
// LibTorch's AdamW and amp's fused one), O6 and O6 with 8-bit state. Beside
// each, the ATen ops a step calls, as LibTorch's profiler records them (on
// a GPU, roughly the kernels a step launches). Each row is one callgrind
// dump; tools/bench/step_instructions.sh runs this under valgrind and prints
// the table.
#include <amp/amp.h>
#include <amp/fused.h>

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>
#include <valgrind/callgrind.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

constexpr int kSteps = 50, kWarmSteps = 5;
constexpr int64_t kWidth = 64, kBatch = 8, kClasses = 10;

// Three 64 x 64 layers with layer norms between: ten parameter tensors, the
// weights 4096 values each (the least that 8-bit state packs).
torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(kWidth, kWidth), torch::nn::LayerNorm(std::vector<int64_t>{kWidth}),
                               torch::nn::ReLU(), torch::nn::Linear(kWidth, kWidth),
                               torch::nn::LayerNorm(std::vector<int64_t>{kWidth}), torch::nn::ReLU(),
                               torch::nn::Linear(kWidth, kClasses));
}

enum class Loop { kFloat32, kNativeAutocast, kAmp };

struct Row {
  std::string name;
  Loop loop;
  std::optional<amp::OptLevel> level;
  bool fused = false;
  bool eight_bit_state = false;
};

// LibTorch's native autocast (bfloat16 on the CPU) and the loss-scaling loop
// users write around it: what GradScaler does, op for op, in C++.
class NativeScalerLoop {
 public:
  explicit NativeScalerLoop(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {}

  void step(torch::nn::Sequential& model, const at::Tensor& x, const at::Tensor& y) {
    optimizer_.zero_grad();
    at::Tensor loss;
    {
      at::autocast::set_autocast_enabled(at::kCPU, true);
      loss = torch::cross_entropy_loss(model->forward(x), y);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    }
    (loss * scale_).backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : model->parameters()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    found_inf_.zero_();
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, scale_.reciprocal());
    if (found_inf_.item<float>() == 0) optimizer_.step();
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, 2.0, 0.5, 2000);
  }

 private:
  torch::optim::Optimizer& optimizer_;
  at::Tensor scale_ = torch::full({}, 65536.0f), growth_tracker_ = torch::zeros({}, at::kInt),
             found_inf_ = torch::zeros({1});
};

// The ATen ops one call of `step` runs, as the profiler's events name them.
int64_t aten_ops_of(const std::function<void()>& step) {
  namespace profiler = torch::autograd::profiler;
  const profiler::ProfilerConfig config(profiler::ProfilerState::KINETO, /*report_input_shapes=*/false,
                                        /*profile_memory=*/false);
  const std::set<torch::profiler::impl::ActivityType> cpu{torch::profiler::impl::ActivityType::CPU};
  profiler::prepareProfiler(config, cpu);
  profiler::enableProfiler(config, cpu);
  step();
  const auto result = profiler::disableProfiler();
  int64_t ops = 0;
  for (const auto& event : result->events()) ops += event.name().rfind("aten::", 0) == 0;
  return ops;
}

void measure(const Row& row, const at::Tensor& x, const at::Tensor& y) {
  torch::nn::Sequential model = make_model();
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (row.fused) {
    optimizer = std::make_unique<amp::optim::FusedAdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  } else {
    optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  }
  std::optional<amp::Handle> handle;
  std::optional<NativeScalerLoop> native;
  std::function<void()> step;
  switch (row.loop) {
    case Loop::kFloat32:
      step = [&] {
        optimizer->zero_grad();
        torch::cross_entropy_loss(model->forward(x), y).backward();
        optimizer->step();
      };
      break;
    case Loop::kNativeAutocast:
      native.emplace(*optimizer);
      step = [&] { native->step(model, x, y); };
      break;
    case Loop::kAmp: {
      amp::Options options = *row.level;
      options.verbosity = 0;
      if (row.eight_bit_state) options.optimizer_state_dtype = at::kByte;
      handle.emplace();
      handle->initialize(model, *optimizer, options);
      step = [&] {
        optimizer->zero_grad();
        const auto loss = torch::cross_entropy_loss(model->forward(x), y);
        {
          amp::scale_loss scaled(loss, *optimizer);
          scaled.backward();
        }
        optimizer->step();
      };
      break;
    }
  }
  for (int i = 0; i < kWarmSteps; ++i) step();  // state created, caches filled, kernels looked up
  const int64_t ops = aten_ops_of(step);
  // The label before the count starts: only the steps are counted.
  const std::string label = row.name + "|" + std::to_string(kSteps) + "|" + std::to_string(ops);
  CALLGRIND_ZERO_STATS;
  for (int i = 0; i < kSteps; ++i) step();
  CALLGRIND_DUMP_STATS_AT(label.c_str());
}

}  // namespace

// argv[1], if given: only the rows whose names contain it (a profile of one row).
int main(int argc, char** argv) {
  if (!RUNNING_ON_VALGRIND) {
    std::fprintf(stderr, "run me through tools/bench/step_instructions.sh (valgrind --tool=callgrind)\n");
    return 2;
  }
  at::set_num_threads(1);
  torch::manual_seed(1);
  const at::Tensor x = torch::randn({kBatch, kWidth}), y = torch::randint(0, kClasses, {kBatch});
  const std::vector<Row> rows = {
      {"LibTorch float32", Loop::kFloat32, std::nullopt},
      {"native autocast + loss-scaling loop", Loop::kNativeAutocast, std::nullopt},
      {"amp O1", Loop::kAmp, amp::O1},
      {"amp O1, fused AdamW", Loop::kAmp, amp::O1, true},
      {"amp O2", Loop::kAmp, amp::O2},
      {"amp O2, fused AdamW", Loop::kAmp, amp::O2, true},
      {"amp O5", Loop::kAmp, amp::O5},
      {"amp O5, fused AdamW", Loop::kAmp, amp::O5, true},
      {"amp O5, fused AdamW, 8-bit state", Loop::kAmp, amp::O5, true, true},
      {"amp O6, fused AdamW", Loop::kAmp, amp::O6, true},
      {"amp O6, fused AdamW, 8-bit state", Loop::kAmp, amp::O6, true, true},
  };
  for (const Row& row : rows) {
    if (argc < 2 || row.name.find(argv[1]) != std::string::npos) measure(row, x, y);
  }
  return 0;
}
