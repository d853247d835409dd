// SPDX-License-Identifier: BSD-3-Clause
// amp::linear_cross_entropy against torch's linear + cross_entropy: equal in
// float64 for every option, as accurate as the unfused layer against a
// float64 reference at every level (tied embeddings, bias, fp16 loss
// scaling), bit for bit under amp::recompute and ZeRO-3, the loss layer's
// memory bounded by the chunk, and its errors.
#include "test_util.h"
#include "world_of_one.h"

#include <amp/linear_cross_entropy.h>
#include <amp/memory.h>

#include <torch/cuda.h>

namespace amp::testing {
namespace {

namespace F = torch::nn::functional;

struct LossCase {
  std::string name;
  F::CrossEntropyFuncOptions options;
  bool bias = true;
  int64_t chunk = 3;
  int64_t vocab_chunk = 0;  // 0: the whole vocabulary at once
};
void PrintTo(const LossCase& c, std::ostream* os) { *os << c.name; }

// The largest |a - b| over two tensors, in float64.
double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.detach().to(at::kDouble).cpu() - b.detach().to(at::kDouble).cpu()).abs().max().item<double>();
}

class LinearCrossEntropyOptionsTest : public AmpTest, public ::testing::WithParamInterface<LossCase> {};

// In float64, where rounding is far below the check, every option agrees
// with torch's unfused layer: loss, and the gradients of hidden, weight and
// bias, through forward's gradients (mean, sum) and backward's (none, with a
// non-uniform incoming gradient).
TEST_P(LinearCrossEntropyOptionsTest, EqualsLinearAndCrossEntropyInFloat64) {
  const LossCase& c = GetParam();
  torch::manual_seed(0);
  const auto f64 = torch::TensorOptions().dtype(at::kDouble);
  const at::Tensor hidden = torch::randn({2, 5, 8}, f64).requires_grad_();
  const at::Tensor weight = torch::randn({11, 8}, f64).requires_grad_();
  const at::Tensor bias = c.bias ? torch::randn({11}, f64).requires_grad_() : at::Tensor();
  at::Tensor target = torch::randint(0, 11, {2, 5});
  target.index_put_({0, 1}, c.options.ignore_index());
  target.index_put_({1, 3}, 7);  // ignored where ignore_index is 7
  const at::Tensor fused = amp::linear_cross_entropy(hidden, weight, bias, target, c.options, c.chunk, c.vocab_chunk);
  const at::Tensor logits = F::linear(hidden, weight, bias).reshape({10, 11});
  const at::Tensor plain = F::cross_entropy(logits, target.reshape({10}), c.options).reshape(fused.sizes());
  ASSERT_EQ(fused.sizes(), plain.sizes());
  EXPECT_EQ(fused.scalar_type(), at::kDouble);
  EXPECT_LT(max_diff(fused, plain), 1e-12) << fused << plain;
  const at::Tensor g = torch::rand(fused.sizes(), f64) + 0.5;  // a weighted sum of the losses
  std::vector<at::Tensor> inputs = {hidden, weight};
  if (c.bias) inputs.push_back(bias);
  const auto fused_grads = torch::autograd::grad({fused}, inputs, {g});
  const auto plain_grads = torch::autograd::grad({plain}, inputs, {g});
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_LT(max_diff(fused_grads[i], plain_grads[i]), 1e-12) << "gradient " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Options, LinearCrossEntropyOptionsTest,
    ::testing::Values(LossCase{"mean", {}}, LossCase{"mean_no_bias", {}, false},
                      LossCase{"sum", F::CrossEntropyFuncOptions().reduction(torch::kSum)},
                      LossCase{"none", F::CrossEntropyFuncOptions().reduction(torch::kNone)},
                      LossCase{"smoothing", F::CrossEntropyFuncOptions().label_smoothing(0.1)},
                      LossCase{"class_weights", F::CrossEntropyFuncOptions().weight(
                                                    torch::rand({11}, at::kDouble) + 0.1)},
                      LossCase{"weights_smoothing_sum", F::CrossEntropyFuncOptions()
                                                            .weight(torch::rand({11}, at::kDouble) + 0.1)
                                                            .label_smoothing(0.25)
                                                            .reduction(torch::kSum)},
                      LossCase{"weights_smoothing_none", F::CrossEntropyFuncOptions()
                                                             .weight(torch::rand({11}, at::kDouble) + 0.1)
                                                             .label_smoothing(0.25)
                                                             .reduction(torch::kNone)},
                      LossCase{"ignore_index_7", F::CrossEntropyFuncOptions().ignore_index(7).label_smoothing(0.1)},
                      LossCase{"one_chunk", {}, true, 0}, LossCase{"chunks_of_one", {}, true, 1},
                      // The vocabulary (11) in windows of 4, 4 and 3 classes, or of one.
                      LossCase{"vocabulary_windows", {}, true, 3, 4},
                      LossCase{"vocabulary_windows_of_one_sum", F::CrossEntropyFuncOptions().reduction(torch::kSum),
                               false, 4, 1},
                      LossCase{"vocabulary_windows_weights_smoothing_none",
                               F::CrossEntropyFuncOptions()
                                   .weight(torch::rand({11}, at::kDouble) + 0.1)
                                   .label_smoothing(0.25)
                                   .reduction(torch::kNone),
                               true, 3, 4},
                      LossCase{"vocabulary_windows_ignore_index_7_smoothing",
                               F::CrossEntropyFuncOptions().ignore_index(7).label_smoothing(0.1), true, 0, 5},
                      LossCase{"vocabulary_window_past_it", {}, true, 3, 50}),
    [](const auto& info) { return info.param.name; });

// A tiny language model: tokens -> embedding -> a tanh layer -> the output
// layer, tied to the embedding (GPT-2's) or a Linear with a bias.
struct TiedLmImpl : torch::nn::Module {
  TiedLmImpl(int64_t vocabulary, int64_t width, bool tied)
      : embed(register_module("embed", torch::nn::Embedding(vocabulary, width))),
        body(register_module("body", torch::nn::Linear(width, width))),
        head(register_module("head", torch::nn::Linear(width, vocabulary))),
        tied(tied) {
    if (tied) unregister_module("head");
  }
  at::Tensor hidden(const at::Tensor& tokens) { return torch::tanh(body(embed(tokens))); }
  at::Tensor out_weight() { return tied ? embed->weight : head->weight; }
  at::Tensor out_bias() { return tied ? at::Tensor() : head->bias; }
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& target, bool fused, int64_t vocab_chunk = 0) {
    const at::Tensor h = hidden(tokens);
    if (fused) return amp::linear_cross_entropy(h, out_weight(), out_bias(), target, {}, /*chunk_tokens=*/5, vocab_chunk);
    const at::Tensor logits = F::linear(h, out_weight(), out_bias());
    return F::cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
  }
  torch::nn::Embedding embed;
  torch::nn::Linear body, head;
  bool tied;
};
TORCH_MODULE(TiedLm);

struct LevelRun {
  at::Tensor loss;
  std::vector<at::Tensor> grads;  // the master weights', true values
};

constexpr int64_t kLmVocabulary = 37, kLmWidth = 16;

// One iteration at `options` (fused or not): the loss, and the gradients
// the optimizer would step after the scale_loss guard. With no options, in
// float64 without amp: the reference.
LevelRun run_level(const std::optional<amp::Options>& options, bool tied, bool fused, int64_t vocab_chunk = 0) {
  torch::manual_seed(3);
  TiedLm model(kLmVocabulary, kLmWidth, tied);
  const at::Tensor tokens = torch::randint(0, kLmVocabulary, {3, 7});
  at::Tensor target = torch::randint(0, kLmVocabulary, {3, 7});
  target.index_put_({1, 2}, -100);
  // O6 rounds its updates stochastically in amp's fused SGD (the same step).
  const torch::optim::SGDOptions sgd(0.1);
  std::unique_ptr<torch::optim::SGD> made =
      options && options->opt_level == amp::OptLevel::O6 ? std::make_unique<amp::optim::FusedSGD>(model->parameters(), sgd)
                                                         : std::make_unique<torch::optim::SGD>(model->parameters(), sgd);
  torch::optim::SGD& optimizer = *made;
  LevelRun run;
  if (!options) {
    model->to(at::kDouble);
    run.loss = model->loss(tokens, target, fused, vocab_chunk);
    run.loss.backward();
    for (const auto& p : model->parameters()) run.grads.push_back(p.grad().clone());
    return run;
  }
  amp::Options o = *options;
  o.verbosity = 0;
  amp::Handle handle;
  handle.initialize(model, optimizer, o);
  run.loss = model->loss(tokens, target, fused, vocab_chunk);
  {
    amp::scale_loss scaled(run.loss, optimizer);
    scaled.backward();
  }
  for (const auto& p : amp::master_params(optimizer)) run.grads.push_back(p.grad().clone());
  return run;
}

class LinearCrossEntropyLevelTest : public AmpTest, public ::testing::WithParamInterface<LevelCase> {};

// At every level, fused and unfused, each against float64: the fused loss
// and gradients are as accurate as the unfused layer's - within twice its
// error, plus one rounding of the GEMMs' dtype (GEMMs over chunks of rows
// take other kernels, whose roundings differ) - tied or not, with the loss
// scale of the level (float16's dynamic scale included); with the
// vocabulary (37) whole and in windows of 10 classes.
TEST_P(LinearCrossEntropyLevelTest, AsAccurateAsLinearAndCrossEntropyAgainstFloat64) {
  const amp::Options options = GetParam().options();
  const at::ScalarType gemm = GetParam().level == amp::O0 ? at::kFloat : options.cpu_dtype.value_or(at::kBFloat16);
  const double rounding = gemm == at::kFloat ? std::ldexp(1.0, -24) : gemm == at::kHalf ? std::ldexp(1.0, -11)
                                                                                       : std::ldexp(1.0, -8);
  for (const auto& [tied, vocab_chunk] : {std::pair{true, 0}, {false, 0}, {true, 10}, {false, 10}}) {
    SCOPED_TRACE("vocabulary windows of " + std::to_string(vocab_chunk));
    const LevelRun reference = run_level(std::nullopt, tied, /*fused=*/false);
    const LevelRun plain = run_level(options, tied, false);
    const LevelRun fused = run_level(options, tied, true, vocab_chunk);
    EXPECT_EQ(fused.loss.scalar_type(), at::kFloat);
    const double loss_error = max_diff(fused.loss, reference.loss);
    EXPECT_LE(loss_error, 2 * max_diff(plain.loss, reference.loss) + rounding * reference.loss.abs().item<double>())
        << "tied " << tied;
    ASSERT_EQ(fused.grads.size(), reference.grads.size());
    for (size_t i = 0; i < fused.grads.size(); ++i) {
      const double scale = reference.grads[i].abs().max().item<double>();
      const double fused_error = max_diff(fused.grads[i], reference.grads[i]);
      const double plain_error = max_diff(plain.grads[i], reference.grads[i]);
      EXPECT_LE(fused_error, 2 * plain_error + rounding * scale)
          << "tied " << tied << ", gradient " << i << ": fused " << fused_error << ", unfused " << plain_error
          << ", largest " << scale;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, LinearCrossEntropyLevelTest, every_level(), level_case_name);

class LinearCrossEntropyTest : public AmpTest {};

// The allocator's peak above what was allocated before `loss` ran, through
// its backward; the gradients of `inputs` are reset after.
int64_t backward_peak(const std::function<at::Tensor()>& loss, std::vector<at::Tensor> inputs) {
  amp::reset_peak_allocated();
  const int64_t before = amp::allocated_bytes().current;
  loss().backward();
  const int64_t peak = amp::allocated_bytes().peak - before;
  for (at::Tensor& input : inputs) input.mutable_grad().reset();
  return peak;
}

// The weight is cast once an iteration through the cast cache, as
// at::linear's would be: a second loss over it hits the cache.
TEST_F(LinearCrossEntropyTest, CastsAFloat32WeightThroughTheCastCache) {
  TiedLm model(kLmVocabulary, kLmWidth, false);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  amp::initialize(model, optimizer, quiet(amp::O1));
  const at::Tensor h = model->hidden(torch::randint(0, kLmVocabulary, {4}));
  const at::Tensor y = torch::randint(0, kLmVocabulary, {4});
  amp::linear_cross_entropy(h, model->head->weight, model->head->bias, y);
  const amp::CastCounts before = amp::cast_counts();
  const at::Tensor loss = amp::linear_cross_entropy(h, model->head->weight, model->head->bias, y);
  const amp::CastCounts after = amp::cast_counts();
  EXPECT_EQ(after.cache_hits - before.cache_hits, 2);  // weight and bias
  EXPECT_EQ(after.casts - before.casts, 0);  // hidden is bfloat16 already
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
}

// Under NoGradGuard only the loss: the same value, no graph.
TEST_F(LinearCrossEntropyTest, UnderNoGradComputesTheSameLossAndNoGraph) {
  const at::Tensor h = torch::randn({6, 8}, torch::requires_grad());
  const at::Tensor w = torch::randn({50, 8}, torch::requires_grad());
  const at::Tensor y = torch::randint(0, 50, {6});
  const at::Tensor with_grad = amp::linear_cross_entropy(h, w, {}, y, {}, 4);
  torch::NoGradGuard no_grad;
  const at::Tensor without = amp::linear_cross_entropy(h, w, {}, y, {}, 4);
  EXPECT_TRUE(BitEqual(with_grad.detach(), without));
  EXPECT_FALSE(without.requires_grad());
}

// retain_graph: a second backward adds the same gradients again; a third
// without the graph is refused by autograd, and create_graph by amp.
TEST_F(LinearCrossEntropyTest, BackwardTwiceWithRetainGraphAddsTheSameGradients) {
  for (auto reduction : {F::CrossEntropyFuncOptions::reduction_t(torch::kMean),
                         F::CrossEntropyFuncOptions::reduction_t(torch::kNone)}) {
    const at::Tensor h = torch::randn({6, 8}, torch::requires_grad());
    const at::Tensor w = torch::randn({50, 8}, torch::requires_grad());
    const at::Tensor y = torch::randint(0, 50, {6});
    const at::Tensor loss = amp::linear_cross_entropy(h, w, {}, y, F::CrossEntropyFuncOptions().reduction(reduction), 4).sum();
    loss.backward({}, /*retain_graph=*/true);
    const at::Tensor once = w.grad().clone();
    loss.backward();
    EXPECT_TRUE(BitEqual(w.grad(), once * 2));
    EXPECT_THROW(loss.backward(), c10::Error);
    const at::Tensor again = amp::linear_cross_entropy(h, w, {}, y, F::CrossEntropyFuncOptions().reduction(reduction), 4).sum();
    EXPECT_AMP_ERROR(torch::autograd::grad({again}, {w}, {}, true, /*create_graph=*/true), "not twice differentiable");
  }
}

// The loss layer's peak (logits, softmax and their gradients, beyond the
// gradients themselves) is set by the chunk, not tokens x vocabulary.
TEST_F(LinearCrossEntropyTest, ItsPeakIsBoundedByTheChunkNotByTokensTimesVocabulary) {
  amp::track_allocations();
  constexpr int64_t kTokens = 1024, kVocab = 4096, kHidden = 32, kChunk = 32;
  const at::Tensor h = torch::randn({kTokens, kHidden}, torch::requires_grad());
  const at::Tensor w = torch::randn({kVocab, kHidden}, torch::requires_grad());
  const at::Tensor y = torch::randint(0, kVocab, {kTokens});
  const int64_t logits_bytes = kTokens * kVocab * 4, chunk_bytes = kChunk * kVocab * 4;
  const int64_t gradient_bytes = (kTokens + kVocab) * kHidden * 4;
  auto peak_of = [&](const std::function<at::Tensor()>& loss) { return backward_peak(loss, {h, w}); };
  for (auto reduction : {F::CrossEntropyFuncOptions::reduction_t(torch::kMean),
                         F::CrossEntropyFuncOptions::reduction_t(torch::kNone)}) {
    const auto options = F::CrossEntropyFuncOptions().reduction(reduction);
    const int64_t fused = peak_of([&] { return amp::linear_cross_entropy(h, w, {}, y, options, kChunk).sum(); });
    const int64_t plain = peak_of([&] { return F::cross_entropy(F::linear(h, w), y, options).sum(); });
    EXPECT_GT(plain, 2 * logits_bytes);
    // Forward's gradients are held once more while backward scales them.
    EXPECT_LT(fused, 4 * chunk_bytes + 2 * gradient_bytes + (1 << 16)) << "unfused " << plain;
    EXPECT_LT(fused * 10, plain);
    // Windows of 512 classes: chunks of 256 tokens in the same bound.
    const int64_t windowed =
        peak_of([&] { return amp::linear_cross_entropy(h, w, {}, y, options, 8 * kChunk, kVocab / 8).sum(); });
    EXPECT_LT(windowed, 4 * chunk_bytes + 2 * gradient_bytes + (1 << 16)) << "unfused " << plain;
  }
}

// In bfloat16 the weight's gradient is summed in float32 (below): with the
// vocabulary in windows that sum is a window's rows, not the whole weight's -
// through forward's gradients (mean) and backward's (none) alike.
TEST_F(LinearCrossEntropyTest, InWindowsTheWeightsFloat32SumIsAWindows) {
  amp::track_allocations();
  constexpr int64_t kTokens = 256, kVocab = 4096, kHidden = 256, kChunk = 64, kWindow = 512;
  const at::Tensor h = torch::randn({kTokens, kHidden}).to(at::kBFloat16).requires_grad_();
  const at::Tensor w = torch::randn({kVocab, kHidden}).to(at::kBFloat16).requires_grad_();
  const at::Tensor y = torch::randint(0, kVocab, {kTokens});
  const int64_t gradient_bytes = (kTokens + kVocab) * kHidden * 2, weight_sum_bytes = kVocab * kHidden * 4;
  // The window's float32 sum and (CPU) its weight rows in float32, the
  // hidden rows' float32 sum, and a few chunks' logits.
  const int64_t window_bytes = 2 * kWindow * kHidden * 4 + kTokens * kHidden * 4 + 4 * kChunk * kWindow * 4;
  auto peak_of = [&](const std::function<at::Tensor()>& loss) { return backward_peak(loss, {h, w}); };
  for (auto reduction : {F::CrossEntropyFuncOptions::reduction_t(torch::kMean),
                         F::CrossEntropyFuncOptions::reduction_t(torch::kNone)}) {
    const auto options = F::CrossEntropyFuncOptions().reduction(reduction);
    const int64_t whole = peak_of([&] { return amp::linear_cross_entropy(h, w, {}, y, options, kChunk).sum(); });
    const int64_t windowed =
        peak_of([&] { return amp::linear_cross_entropy(h, w, {}, y, options, kChunk, kWindow).sum(); });
    EXPECT_GT(whole, gradient_bytes + weight_sum_bytes);
    EXPECT_LT(windowed, gradient_bytes + window_bytes + (1 << 16)) << "whole vocabulary " << whole;
  }
}

// A real batch walks many chunks: the weight's gradient, summed over them,
// is as accurate against float64 as the unfused layer's one GEMM over all
// tokens (within twice its error, where summing 128 shares in bfloat16 is
// 3-8 times it) - in bfloat16 and float16 inputs, 128 chunks of 32 tokens,
// with and without windows of the vocabulary, on `device`.
void expect_many_chunks_as_accurate_as_one_gemm(at::Device device) {
  constexpr int64_t kTokens = 4096, kVocab = 512, kHidden = 64, kChunk = 32;
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    torch::manual_seed(5);
    const at::Tensor h = torch::randn({kTokens, kHidden}).to(device, dtype).requires_grad_();
    const at::Tensor w = (torch::randn({kVocab, kHidden}) * 0.5).to(device, dtype).requires_grad_();
    const at::Tensor y = torch::randint(0, kVocab, {kTokens}).to(device);
    const at::Tensor h64 = h.detach().to(at::kDouble).requires_grad_(), w64 = w.detach().to(at::kDouble).requires_grad_();
    F::cross_entropy(F::linear(h64, w64), y).backward();
    auto errors = [&](const std::function<at::Tensor()>& loss) {
      h.mutable_grad().reset();
      w.mutable_grad().reset();
      loss().backward();
      return std::pair{max_diff(h.grad(), h64.grad()), max_diff(w.grad(), w64.grad())};
    };
    const auto [plain_h, plain_w] = errors([&] { return F::cross_entropy(F::linear(h, w).to(at::kFloat), y); });
    for (int64_t window : {int64_t{0}, kVocab / 4}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + ", windows of " + std::to_string(window));
      const auto [fused_h, fused_w] = errors([&] { return amp::linear_cross_entropy(h, w, {}, y, {}, kChunk, window); });
      EXPECT_LE(fused_h, 2 * plain_h) << "unfused " << plain_h;
      EXPECT_LE(fused_w, 2 * plain_w) << "unfused " << plain_w;
    }
  }
}

TEST_F(LinearCrossEntropyTest, OverManyChunksItsGradientsAreAsAccurateAsOneGemms) {
  expect_many_chunks_as_accurate_as_one_gemm(at::kCPU);
}

// The same on CUDA, where the shares sum through cuBLAS's float32 output.
TEST_F(LinearCrossEntropyTest, OnCudaOverManyChunksItsGradientsAreAsAccurateAsOneGemms) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  expect_many_chunks_as_accurate_as_one_gemm(at::kCUDA);
}

// Inside a recomputed block the loss and gradients are the plain call's, bit for bit.
TEST_F(LinearCrossEntropyTest, InsideRecomputeTrainsBitIdentically) {
  for (amp::OptLevel level : {amp::O1, amp::O5}) {
    std::vector<std::vector<at::Tensor>> runs;
    for (bool recompute : {false, true}) {
      torch::manual_seed(5);
      TiedLm model(kLmVocabulary, kLmWidth, true);
      torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
      amp::Handle handle;
      handle.initialize(model, optimizer, quiet(level));
      std::vector<at::Tensor> seen;
      for (int step = 0; step < 2; ++step) {
        const at::Tensor tokens = torch::randint(0, kLmVocabulary, {4, 6});
        const at::Tensor target = torch::randint(0, kLmVocabulary, {4, 6});
        auto loss_of = [model, target](const at::Tensor& t) mutable {
          return amp::linear_cross_entropy(model->hidden(t), model->out_weight(), {}, target, {}, 7);
        };
        optimizer.zero_grad();
        const at::Tensor loss = recompute ? amp::recompute(loss_of, tokens) : loss_of(tokens);
        {
          amp::scale_loss scaled(loss, optimizer);
          scaled.backward();
        }
        optimizer.step();
        seen.push_back(loss.detach().clone());
      }
      for (const auto& p : model->parameters()) seen.push_back(p.detach().clone());
      runs.push_back(seen);
    }
    expect_bit_equal(runs[0], runs[1], "recomputed vs plain");
  }
}

// ZeRO-3 (sharded weights, one rank in process): the weight is read as any
// op reads it, so training equals the unsharded data-parallel run bit for bit.
TEST_F(LinearCrossEntropyTest, WithShardedWeightsTrainsAsWithoutSharding) {
  std::vector<std::vector<at::Tensor>> runs;
  for (bool shard_weights : {false, true}) {
    torch::manual_seed(6);
    TiedLm model(kLmVocabulary, kLmWidth, false);
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
    amp::Options options = quiet(amp::O2);
    options.data_parallel.group = c10::make_intrusive<WorldOfOne>();
    options.data_parallel.bucket_bytes = 256;
    options.data_parallel.shard = true;
    options.data_parallel.shard_weights = shard_weights;
    amp::Handle handle;
    handle.initialize(model, optimizer, options);
    std::vector<at::Tensor> seen;
    for (int step = 0; step < 3; ++step) {
      const at::Tensor tokens = torch::randint(0, kLmVocabulary, {4, 6});
      const at::Tensor target = torch::randint(0, kLmVocabulary, {4, 6});
      optimizer.zero_grad();
      const at::Tensor loss = model->loss(tokens, target, /*fused=*/true);
      {
        amp::scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      seen.push_back(loss.detach().clone());
    }
    handle.deinitialize();
    for (const auto& p : model->parameters()) seen.push_back(p.detach().clone());
    runs.push_back(seen);
  }
  expect_bit_equal(runs[0], runs[1], "ZeRO-3 vs ZeRO-2");
}

// On CUDA (ATen's kernels per chunk): as accurate against float64 as the
// unfused layer, in bfloat16 (gradients in forward) and float16 with a
// per-token incoming gradient (recomputed in backward).
TEST_F(LinearCrossEntropyTest, OnCudaIsAsAccurateAsTheUnfusedLayer) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const auto options = dtype == at::kHalf ? F::CrossEntropyFuncOptions().reduction(torch::kNone).label_smoothing(0.1)
                                            : F::CrossEntropyFuncOptions().label_smoothing(0.1);
    torch::manual_seed(8);
    const at::Tensor h64 = torch::randn({300, 64}, at::kDouble), w64 = torch::randn({5000, 64}, at::kDouble) * 0.1;
    const at::Tensor y = torch::randint(0, 5000, {300}).cuda();
    const at::Tensor g = torch::rand({300}, at::kDouble).cuda() + 0.5;
    auto grads_of = [&](const at::Tensor& h_in, const at::Tensor& w_in, bool fused) {
      const at::Tensor h = h_in.detach().requires_grad_(), w = w_in.detach().requires_grad_();
      at::Tensor loss = fused ? amp::linear_cross_entropy(h, w, {}, y, options, 64)
                              : F::cross_entropy(F::linear(h, w).to(h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat), y, options);
      loss = loss.dim() == 0 ? loss : (loss.to(at::kDouble) * g).sum();
      loss.backward();
      return std::vector<at::Tensor>{loss.detach(), h.grad(), w.grad()};
    };
    const auto reference = grads_of(h64.cuda(), w64.cuda(), false);
    const auto plain = grads_of(h64.to(dtype).cuda(), w64.to(dtype).cuda(), false);
    const auto fused = grads_of(h64.to(dtype).cuda(), w64.to(dtype).cuda(), true);
    const double rounding = dtype == at::kHalf ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    for (size_t i = 0; i < 3; ++i) {
      const double scale = reference[i].abs().max().item<double>();
      EXPECT_LE(max_diff(fused[i], reference[i]), 2 * max_diff(plain[i], reference[i]) + rounding * scale)
          << c10::toString(dtype) << " output " << i;
    }
  }
}

// With the fp8 property the output layer's GEMMs run in float8 in the fused
// loss as in the unfused layer: as accurate against float64 (within twice
// its error plus one float8 rounding: a chunk's rows take their own scale
// before the first guard), unlike the fused loss at O5 (the same bits
// without float8 would mean the GEMMs never ran in float8), and the layer
// named among amp::fp8_choices as float8.
TEST_F(LinearCrossEntropyTest, UnderFp8TheOutputLayersGemmsRunInFloat8AsUnfused) {
  const double float8_rounding = std::ldexp(1.0, -3);  // e5m2, the gradients' format
  for (bool tied : {true, false}) {
    const LevelRun reference = run_level(std::nullopt, tied, /*fused=*/false);
    const LevelRun plain = run_level(fp8_options(), tied, false);
    const LevelRun fused = run_level(fp8_options(), tied, true);
    const LevelRun fused_bf16 = run_level(amp::O5, tied, true);
    EXPECT_LE(max_diff(fused.loss, reference.loss),
              2 * max_diff(plain.loss, reference.loss) + float8_rounding * reference.loss.abs().item<double>());
    bool differs_from_bf16 = false;
    for (size_t i = 0; i < fused.grads.size(); ++i) {
      const double scale = reference.grads[i].abs().max().item<double>();
      EXPECT_LE(max_diff(fused.grads[i], reference.grads[i]),
                2 * max_diff(plain.grads[i], reference.grads[i]) + float8_rounding * scale)
          << "tied " << tied << ", gradient " << i;
      differs_from_bf16 = differs_from_bf16 || !BitEqual(fused.grads[i], fused_bf16.grads[i]);
    }
    EXPECT_TRUE(differs_from_bf16) << "tied " << tied << ": the fused loss's gradients are O5's without float8";
  }
  TiedLm model(kLmVocabulary, kLmWidth, /*tied=*/false);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  Handle handle;
  handle.initialize(model, optimizer, fp8_options());
  const at::Tensor tokens = torch::randint(0, kLmVocabulary, {3, 7});
  model->loss(tokens, torch::randint(0, kLmVocabulary, {3, 7}), /*fused=*/true).backward();
  const auto choices = amp::fp8_choices();
  const auto head = std::find_if(choices.begin(), choices.end(), [](const Fp8LayerChoice& c) { return c.layer == "head.weight"; });
  ASSERT_NE(head, choices.end());
  EXPECT_TRUE(head->float8);
  EXPECT_EQ(head->rows, 21);
  EXPECT_EQ(head->out, kLmVocabulary);
}

// Where the rule keeps the layer in bfloat16 (its intensity below
// min_gemm_intensity) the fused loss is O5's, bit for bit.
TEST_F(LinearCrossEntropyTest, UnderFp8ALayerTheRuleKeepsInBfloat16IsO5s) {
  amp::Options options = fp8_options();
  options.fp8_scaling.min_gemm_intensity = 1e9;
  const LevelRun kept = run_level(options, /*tied=*/false, /*fused=*/true);
  const LevelRun o5 = run_level(amp::O5, false, true);
  EXPECT_TRUE(BitEqual(kept.loss, o5.loss));
  expect_bit_equal(kept.grads, o5.grads, "gradient");
}

// Three iterations under delayed scaling (the scales from the amax
// histories, rolled by each guard): the fused float8 loss follows the
// unfused float8 layer within float8 roundings, its backward (recomputing
// each chunk's logits for a loss without reduction's gradients computed in
// forward) included.
TEST_F(LinearCrossEntropyTest, UnderFp8DelayedScalingFollowsTheUnfusedLayer) {
  auto train = [](bool fused) {
    torch::manual_seed(5);
    TiedLm model(kLmVocabulary, kLmWidth, /*tied=*/false);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    Handle handle;
    handle.initialize(model, optimizer, fp8_options());
    std::vector<at::Tensor> losses;
    for (int step = 0; step < 3; ++step) {
      const at::Tensor tokens = torch::randint(0, kLmVocabulary, {4, 8});
      const at::Tensor target = torch::randint(0, kLmVocabulary, {4, 8});
      optimizer.zero_grad();
      const at::Tensor h = model->hidden(tokens);
      const F::CrossEntropyFuncOptions none = F::CrossEntropyFuncOptions().reduction(torch::kNone);
      const at::Tensor per_token =
          fused ? amp::linear_cross_entropy(h, model->head->weight, model->head->bias, target, none, 8)
                : F::cross_entropy(F::linear(h, model->head->weight, model->head->bias).reshape({-1, kLmVocabulary}),
                                   target.reshape({-1}), none);
      const at::Tensor loss = per_token.to(at::kFloat).mean();
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      losses.push_back(loss.detach());
    }
    return std::make_pair(losses, model->head->weight.detach().to(at::kFloat).clone());
  };
  const auto [fused_losses, fused_weight] = train(true);
  const auto [plain_losses, plain_weight] = train(false);
  for (size_t i = 0; i < fused_losses.size(); ++i) {
    EXPECT_NEAR(fused_losses[i].item<double>(), plain_losses[i].item<double>(), 0.02 * plain_losses[i].item<double>())
        << "step " << i;
  }
  EXPECT_LE(max_diff(fused_weight, plain_weight), 0.01 * plain_weight.abs().max().item<double>());
}

TEST_F(LinearCrossEntropyTest, RefusesBadInputBeforeComputingAnything) {
  const at::Tensor h = torch::randn({2, 3, 8}, torch::requires_grad());
  const at::Tensor w = torch::randn({10, 8}, torch::requires_grad());
  const at::Tensor y = torch::randint(0, 10, {2, 3});
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w.t(), {}, y), "hidden must be [..., 10]");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w[0], {}, y), "weight must be [vocabulary, width]");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w, torch::zeros({9}), y), "bias must be [10]");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w, {}, y.to(at::kFloat)), "target must be an integer tensor");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w, {}, y.reshape({6})), "target must have hidden's shape");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w, {}, y + 10), "a target is outside [0, 10)");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w.to(at::kBFloat16), {}, y), "differ in dtype");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w, {}, y, F::CrossEntropyFuncOptions().label_smoothing(1.5)),
                   "label smoothing must be in [0, 1]");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w, {}, y, {}, -1), "chunk_tokens must be >= 0");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w, {}, y, {}, 0, -2), "chunk_vocabulary must be >= 0");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(h, w, {}, y, F::CrossEntropyFuncOptions().weight(torch::ones({9}))),
                   "class weights must be a floating [10] tensor");
  EXPECT_AMP_ERROR(amp::linear_cross_entropy(
                       h, w, {}, y, F::CrossEntropyFuncOptions().weight(torch::ones({10}, torch::requires_grad()))),
                   "class weights are constants here");
  EXPECT_FALSE(h.grad().defined());
  EXPECT_FALSE(w.grad().defined());
}

TEST_F(LinearCrossEntropyTest, PicksChunksOfAtMost32MiBOfFloat32Logits) {
  EXPECT_EQ(amp::default_loss_chunk_tokens(8192, 50304), 128);
  EXPECT_EQ(amp::default_loss_chunk_tokens(8192, 8192), 1024);  // a window of 8192 classes
  EXPECT_EQ(amp::default_loss_chunk_tokens(8192, 256), 8192);
  EXPECT_EQ(amp::default_loss_chunk_tokens(100, 10), 100);
  EXPECT_EQ(amp::default_loss_chunk_tokens(4096, 1 << 24), 1);
}

}  // namespace
}  // namespace amp::testing
