// SPDX-License-Identifier: BSD-3-Clause
// The precision report's table for a known tiny model, asserted exactly.
#include "test_util.h"

#include <torch/cuda.h>

namespace amp::testing {
namespace {

using OpStatsTest = AmpTest;

TEST_F(OpStatsTest, OneO1IterationOfTinyNetGivesExactlyTheseRows) {
  torch::manual_seed(0);
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
  OpStatsRecorder recorder;
  const auto x = torch::randn({2, 8}), target = torch::randn({2, 4});
  const auto loss = torch::mse_loss(model->forward(x), target);
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();  // casts are off inside the guard: nothing recorded
  }
  optimizer->step();
  // nn::Linear runs addmm(bias, input, weight.t()); bf16 is 2 bytes.
  EXPECT_EQ(format_op_stats(recorder.stats()),
            "| op | device | policy | input dtypes | output | calls | casts | cache hits | bytes cast |\n"
            "|---|---|---|---|---|---:|---:|---:|---:|\n"
            "| aten::addmm | cpu | lower_precision | Float, BFloat16, Float | BFloat16 | 1 | 2 | 0 | 136 |\n"
            "| aten::addmm | cpu | lower_precision | Float, Float, Float | BFloat16 | 1 | 3 | 0 | 320 |\n"
            "| aten::mse_loss | cpu | fp32 | BFloat16, Float | Float | 1 | 1 | 0 | 32 |\n");
}

TEST_F(OpStatsTest, CacheHitsAndBackwardCallsAreReported) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  OpStatsRecorder recorder;
  const auto x = torch::randn({2, 8}, torch::requires_grad());
  model->forward(x);
  const auto out = model->forward(x);
  out.to(at::kFloat).sum().backward();  // outside scale_loss: recorded as backward
  int64_t hits = 0, backward_rows = 0;
  for (const auto& row : recorder.stats()) {
    hits += row.cache_hits;
    if (row.in_backward) {
      ++backward_rows;
      EXPECT_EQ(row.casts, 0);
    }
  }
  // Second forward: both weights, both biases, and x - a leaf that requires
  // grad is cached like a weight (as in LibTorch's autocast).
  EXPECT_EQ(hits, 5);
  EXPECT_GT(backward_rows, 0);
  EXPECT_THAT(format_op_stats(recorder.stats()), ::testing::HasSubstr("passthrough (backward)"));
}

// CUDA backward runs on autograd's device thread; its calls are recorded
// there, as backward, never cast.
TEST_F(OpStatsTest, BackwardOnAutogradsCudaThreadIsRecorded) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  auto model = TinyNet();
  model->to(torch::kCUDA);
  Handle handle;
  handle.initialize(model, quiet(O1));
  OpStatsRecorder recorder;
  model->forward(torch::randn({2, 8}, torch::kCUDA)).to(at::kFloat).sum().backward();
  int64_t forward_casts = 0, backward_rows = 0;
  for (const auto& row : recorder.stats()) {
    EXPECT_EQ(row.device, c10::DeviceType::CUDA);
    if (row.in_backward) {
      ++backward_rows;
      EXPECT_EQ(row.casts, 0);
    } else {
      forward_casts += row.casts;
    }
  }
  EXPECT_GT(forward_casts, 0);
  EXPECT_GT(backward_rows, 0);
}

TEST_F(OpStatsTest, OnlyOneRecorderAtATime) {
  OpStatsRecorder first;
  EXPECT_AMP_ERROR(OpStatsRecorder second, "already recording");
}

}  // namespace
}  // namespace amp::testing
