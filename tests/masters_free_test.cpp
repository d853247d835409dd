// SPDX-License-Identifier: BSD-3-Clause
// O6: bfloat16 weights without float32 masters, updates computed in float32
// by amp's fused optimizers and rounded into the weights stochastically.
// The rounding is unbiased (against float64), brackets the exact update,
// trains where rounding to nearest stalls, is reproducible from the seed and
// resumes bit for bit; LibTorch's own optimizers are refused.
#include "test_util.h"

#include "cpu_capability.h"

#include "optim/widened_step_kernels.h"
#include "optim/stochastic_rounding.h"

#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/util/bit_cast.h>

#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <vector>

namespace amp::testing {
namespace {

// One parameter vector of `n` elements: loss = sum(w * c) has gradient c.
struct VectorModelImpl : torch::nn::Module {
  explicit VectorModelImpl(at::Tensor init) : w(register_parameter("w", std::move(init))) {}
  at::Tensor w;
};
TORCH_MODULE(VectorModel);

Options o6(std::function<void(Options&)> edit = nullptr) {
  Options options = O6;
  options.verbosity = 0;
  if (edit) edit(options);
  return options;
}

constexpr double kUlp = 0.0078125;  // bfloat16's spacing in [1, 2): 2^-7

// One step of FusedSGD from every weight at `start` with gradient
// `gradient` (both exact in bfloat16, |start| in [1, 2)): the float32
// update start - lr * gradient lies between two bfloat16 neighbours, and
// `lr` (any float32) places it anywhere between them. Returns the weights
// after the step, as float64, and the float32 value they were rounded from.
std::pair<at::Tensor, double> one_sgd_step(double start, double gradient, float lr, int64_t n, const Options& options,
                                           c10::Device device = c10::kCPU) {
  VectorModel model(torch::full({n}, start));
  model->to(device);
  amp::optim::FusedSGD optimizer(model->parameters(), torch::optim::SGDOptions(lr));
  Handle handle;
  handle.initialize(model, optimizer, options);
  EXPECT_EQ(model->w.scalar_type(), at::kBFloat16);
  optimizer.zero_grad();
  const at::Tensor loss = (model->w.to(at::kFloat) * gradient).sum();
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
  const float exact = static_cast<float>(start) - lr * static_cast<float>(gradient);
  return {model->w.detach().cpu().to(at::kDouble), exact};
}

// Every weight is one of the two bfloat16 neighbours of `exact`, and their
// mean is within 5 standard errors of `exact`, the mean of Bernoulli draws
// of the neighbours that stochastic rounding is.
::testing::AssertionResult IsUnbiased(const at::Tensor& w, double exact) {
  const double low = std::floor(exact / kUlp) * kUlp, p = (exact - low) / kUlp;
  if (!torch::logical_or(w == low, w == low + kUlp).all().item<bool>()) {
    return ::testing::AssertionFailure() << "a weight is neither neighbour of " << exact;
  }
  const double mean = w.mean().item<double>(), error = kUlp * std::sqrt(p * (1 - p) / w.numel());
  if (std::abs(mean - exact) > 5 * error) {
    return ::testing::AssertionFailure() << "mean " << mean << " is " << (mean - exact) / error
                                         << " standard errors from " << exact;
  }
  return ::testing::AssertionSuccess();
}

// A rounding with fewer random bits than the 16 below bfloat16's cut: it
// cannot tell apart values closer than 2^-bits of an ulp, a bias of up to
// that much. The check above must see it.
at::Tensor round_with_random_bits_of(const at::Tensor& values, int bits) {
  const at::Tensor pattern = values.contiguous().view(at::kInt);
  const at::Tensor noise = torch::randint(0, 1 << bits, values.sizes(), at::kInt) * (1 << (16 - bits));
  return (pattern + noise).bitwise_and(static_cast<int32_t>(0xFFFF0000u)).view(at::kFloat).to(at::kDouble);
}
at::Tensor round_with_random_bits(float exact, int64_t n, int bits) {
  return round_with_random_bits_of(torch::full({n}, exact), bits);
}

// Fractions of an ulp drawn at random (not on a grid that a rounding with
// 4-8 random bits would still treat exactly), from above and below zero,
// updates towards and away from it: the mean lands on the float32 update.
TEST_F(AmpTest, StochasticRoundingIsUnbiasedAgainstFloat64) {
  constexpr int64_t kN = 1 << 22;
  std::mt19937 draw(2026);
  std::vector<float> fractions(3);
  for (float& f : fractions) f = std::uniform_real_distribution<float>(0.02f, 0.98f)(draw);
  bool weakened_caught = false;
  for (float fraction : fractions) {
    for (double start : {1.5, -1.5}) {
      for (double gradient : {kUlp, -kUlp}) {
        SCOPED_TRACE("fraction " + std::to_string(fraction) + " start " + std::to_string(start) + " gradient " +
                     std::to_string(gradient));
        torch::manual_seed(1);
        const auto [w, exact] = one_sgd_step(start, gradient, fraction, kN, o6());
        EXPECT_TRUE(IsUnbiased(w, exact));
        weakened_caught = weakened_caught || !IsUnbiased(round_with_random_bits(exact, kN, 8), exact);
      }
    }
  }
  EXPECT_TRUE(weakened_caught) << "a rounding with 8 random bits passed every fraction";
  EXPECT_TRUE(IsUnbiased(round_with_random_bits(1.5f + fractions[0] * kUlp, kN, 16), 1.5 + fractions[0] * kUlp));
  // Rounding to nearest drops the same update entirely below half an ulp.
  const auto [nearest, exact] =
      one_sgd_step(1.5, -kUlp, 0.375f, 1024, o6([](Options& o) { o.stochastic_rounding = false; }));
  EXPECT_TRUE((nearest == 1.5).all().item<bool>()) << exact;
}

// Random float32 values of both signs over the exponents bfloat16 shares
// with float32 (2^-133, subnormal, to 2^120), rounded 2^16 times each:
// every result one of the value's two bfloat16 neighbours, their mean the
// value within 5 standard errors. Rounding with 8 random bits (a bias of
// up to 2^-8 ulp) fails the same bound for some values, so the check can
// tell.
TEST(StochasticRoundingTest, UnbiasedOverRandomValuesAndScalesOfBothSigns) {
  constexpr int64_t kValues = 64, kDraws = 1 << 16;
  std::mt19937 draw(7);
  std::vector<float> values(kValues);
  for (float& v : values) {
    // A float32 with random low bits (not on bfloat16's grid, nor on a
    // coarser grid a few random bits could round without bias).
    const int exponent = std::uniform_int_distribution<int>(-133, 120)(draw);
    const float mantissa = std::uniform_real_distribution<float>(1.0f, 2.0f)(draw);
    v = std::ldexp(mantissa, exponent) * (std::bernoulli_distribution(0.5)(draw) ? -1.0f : 1.0f);
  }
  const at::Tensor src = torch::tensor(values).repeat_interleave(kDraws);
  at::Tensor dst = torch::empty_like(src, at::kBFloat16);
  detail::StochasticRounding rounder(/*seed=*/3, /*stream=*/0);
  rounder.round_into(src, dst, {rounder.next_step(), 0});
  const at::Tensor drawn = dst.to(at::kDouble).view({kValues, kDraws});
  const at::Tensor weakened = round_with_random_bits_of(src, 8).view({kValues, kDraws});
  int weakened_caught = 0;
  for (int64_t i = 0; i < kValues; ++i) {
    const double exact = values[i];
    SCOPED_TRACE("value " + std::to_string(exact));
    // The neighbours: the value's bfloat16 truncation (towards zero) and the next one away from zero.
    const double toward = c10::BFloat16(static_cast<uint16_t>(c10::bit_cast<uint32_t>(values[i]) >> 16),
                                        c10::BFloat16::from_bits());
    const double away = c10::BFloat16(static_cast<uint16_t>((c10::bit_cast<uint32_t>(values[i]) >> 16) + 1),
                                      c10::BFloat16::from_bits());
    const at::Tensor row = drawn[i];
    EXPECT_TRUE(torch::logical_or(row == toward, row == away).all().item<bool>());
    const double ulp = std::abs(away - toward), p = std::abs(exact - toward) / ulp;
    const double error = ulp * std::sqrt(p * (1 - p) / kDraws);
    EXPECT_NEAR(row.mean().item<double>(), exact, 5 * error);
    weakened_caught += std::abs(weakened[i].mean().item<double>() - exact) > 5 * error;
  }
  EXPECT_GT(weakened_caught, 0) << "a rounding with 8 random bits passed every value";
}

// The test objects compile with the standard library's bounds checks
// (tests/CMakeLists.txt): an index past a vector, as random_float_bits once
// made, aborts where it is made instead of corrupting the heap.
TEST(TestBuild, AnIndexPastAVectorAbortsWhereItIsMade) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        std::vector<uint32_t> bits(512);
        volatile size_t index = 977 * 7;
        bits[index] = 1;
      },
      "__n < this->size\\(\\)");
}

// Random float32 bits with every kind of float32 among them - every
// exponent, subnormals, signed zeros, the largest finite values (which may
// round up to inf), infinities - and NaN.
at::Tensor random_float_bits(int64_t n) {
  std::mt19937 draw(9);
  std::vector<uint32_t> bits(n);
  for (uint32_t& b : bits) b = static_cast<uint32_t>(draw());
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::quiet_NaN()};
  // Spread over the tensor, whatever its size: (i * 977) % n.
  for (size_t i = 0; i < std::size(specials); ++i) bits[i * 977 % bits.size()] = c10::bit_cast<uint32_t>(specials[i]);
  return torch::from_blob(bits.data(), {n}, at::kInt).view(at::kFloat).clone();
}

// On the CPU a tensor is rounded in one pass, drawing inline: the same bits
// as the ATen ops (CUDA's path) with the draws of ATen's Philox engine, and
// NaN for every NaN, whatever its payload (its bits plus the noise may
// carry into inf, or past the sign into a small number); from a strided
// source too. Another key draws other bits.
TEST(StochasticRoundingTest, TheOnePassRoundingIsTheAtenOpsBits) {
  const at::Tensor src = random_float_bits(100003);
  const auto round = [&](const at::Tensor& from, detail::CpuPath path, uint64_t tensor) {
    detail::StochasticRounding rounder(/*seed=*/3, /*stream=*/1);
    at::Tensor dst = torch::empty(from.sizes(), at::kBFloat16);
    rounder.round_into(from, dst, {5, tensor, 2}, path);
    return dst;
  };
  const at::Tensor one_pass = round(src, detail::CpuPath::kOnePass, 7), aten = round(src, detail::CpuPath::kAtenOps, 7);
  EXPECT_GT(src.isnan().sum().item<int64_t>(), 100) << "random bits hold NaNs";
  const at::Tensor nan = src.isnan();
  EXPECT_TRUE(aten.isnan().equal(nan) && one_pass.isnan().equal(nan));
  EXPECT_TRUE(BitEqual(one_pass.masked_fill(nan, 0), aten.masked_fill(nan, 0)));
  EXPECT_FALSE(BitEqual(one_pass, round(src, detail::CpuPath::kOnePass, 8)));
  const at::Tensor strided = src.narrow(0, 0, 100000).view({400, 250}).t();
  EXPECT_TRUE(BitEqual(round(strided, detail::CpuPath::kOnePass, 7).masked_fill(strided.isnan(), 0),
                       round(strided, detail::CpuPath::kAtenOps, 7).masked_fill(strided.isnan(), 0)));
}

// On CUDA the chunk's tensors are rounded in one launch (a launch takes
// 666: here two), drawing what at::randint draws for each tensor alone - the
// same thread, counter and lane of its grid, so each of several passes over
// the largest - and writing the ATen ops' bits, NaNs included. Builds with
// amp's CUDA kernels must take them.
TEST(StochasticRoundingTest, OnCudaTheKernelIsTheAtenOpsBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
#ifdef AMP_TEST_CUDA_KERNELS
  EXPECT_TRUE(detail::widened_step_kernels_apply(torch::ones({1}, torch::kCUDA)));
#else
  GTEST_SKIP() << "this build has no CUDA kernels (no CUDA compiler): ATen ops round";
#endif
  std::vector<int64_t> sizes = {1, 3, 255, 256, 257, 1000, 4099, int64_t{1} << 20, 3'000'000};
  std::mt19937 draw(11);
  while (sizes.size() < 700) sizes.push_back(std::uniform_int_distribution<int64_t>(1, 3000)(draw));
  detail::StochasticRounding rounder(/*seed=*/3, /*stream=*/1);
  std::vector<detail::StochasticRounding::Rounding> kernel, aten;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const at::Tensor src = random_float_bits(sizes[i]).cuda();
    const detail::RoundingKey key{5, i, i % 3};
    kernel.push_back({src, torch::empty({sizes[i]}, torch::dtype(at::kBFloat16).device(torch::kCUDA)), key});
    aten.push_back({src, torch::empty_like(kernel.back().dst), key});
  }
  rounder.round_all(kernel);
  rounder.round_all(aten, detail::CpuPath::kAtenOps);
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_TRUE(BitEqual(kernel[i].dst.cpu(), aten[i].dst.cpu())) << sizes[i] << " values";
  }
  EXPECT_GT(kernel[8].src.isnan().sum().item<int64_t>(), 100) << "random bits hold NaNs";
  // Another stream draws other bits.
  detail::StochasticRounding::Rounding other = kernel[8];
  other.dst = torch::empty_like(other.dst);
  other.key.part += 1;
  rounder.round_all({other});
  EXPECT_FALSE(BitEqual(other.dst.cpu(), kernel[8].dst.cpu()));
}

// The CPU's draws are Philox4x32-10's: ATen's engine, which the ATen ops
// draw with, gives Random123's known answers (kat_vectors).
TEST(StochasticRoundingTest, TheCpuDrawsArePhilox4x32_10) {
  const auto block = [](uint64_t key, uint64_t counter_high, uint64_t counter_low) {
    at::philox_engine engine(key, counter_high, counter_low);
    std::array<uint32_t, 4> out{};
    for (uint32_t& x : out) x = engine();
    return out;
  };
  EXPECT_EQ(block(0, 0, 0), (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(block(~uint64_t{0}, ~uint64_t{0}, ~uint64_t{0}),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(block(0x299f31d0a4093822, 0x0370734413198a2e, 0x85a308d3243f6a88),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
  // Draw i of a stream is output i % 4 of counter i / 4.
  const at::Tensor draws = detail::StochasticRounding::cpu_draws(0, 8);
  const auto second = block(0, 0, 1);
  EXPECT_EQ(static_cast<uint32_t>(draws[5].item<int32_t>()), second[1]);
}

// The rounding is compiled once per CPU capability
// (optim/one_pass_kernels.h): each that this CPU runs writes the ATen ops'
// bits, over a whole tensor and over ranges that start inside it.
class RoundingKernelTest : public CpuCapabilityTest {};

TEST_P(RoundingKernelTest, WritesTheAtenOpsBits) {
  const at::Tensor src = random_float_bits(100003);
  detail::StochasticRounding rounder(/*seed=*/3, /*stream=*/1);
  at::Tensor aten = torch::empty(src.sizes(), at::kBFloat16);
  rounder.round_into(src, aten, {5, 7, 2}, detail::CpuPath::kAtenOps);
  for (const int64_t split : {int64_t{0}, int64_t{8}, int64_t{2056}, int64_t{65536}}) {
    SCOPED_TRACE("ranges split at " + std::to_string(split));
    at::Tensor dst = torch::empty(src.sizes(), at::kBFloat16);
    const auto* in = reinterpret_cast<const uint32_t*>(src.const_data_ptr<float>());
    auto* out = reinterpret_cast<uint16_t*>(dst.mutable_data_ptr<at::BFloat16>());
    const uint64_t seed = rounder.stream_seed({5, 7, 2});
    kernels().round_to_bfloat16(in, out, 0, split, seed);
    kernels().round_to_bfloat16(in, out, split, src.numel() - split, seed);
    const at::Tensor nan = src.isnan();
    EXPECT_TRUE(dst.isnan().equal(nan));
    EXPECT_TRUE(BitEqual(dst.masked_fill(nan, 0), aten.masked_fill(nan, 0)));
  }
}

// A range whose counters cross 2^32 (a tensor of over 2^35 values): the
// draws go on into the counter's high word, as ATen's engine's do.
TEST_P(RoundingKernelTest, DrawsOnPastTheCountersLowWord) {
  const at::Tensor src = random_float_bits(512);
  const auto* in = reinterpret_cast<const uint32_t*>(src.const_data_ptr<float>());
  const int64_t first = 8 * ((int64_t{1} << 32) - 13);  // counters 2^32 - 13 to 2^32 + 51
  const uint64_t seed = 0x243F6A8885A308D3ull;
  std::vector<uint16_t> out(src.numel());
  kernels().round_to_bfloat16(in - first, out.data() - first, first, src.numel(), seed);
  at::philox_engine engine(seed, /*subsequence=*/0, /*offset=*/first / 8);
  for (int64_t i = 0; i < src.numel(); i += 2) {
    const uint32_t draw = engine();
    for (const int64_t k : {i, i + 1}) {
      const uint32_t noise = k == i ? draw & 0xFFFF : draw >> 16;
      const bool nan = (in[k] & 0x7FFFFFFFu) > 0x7F800000u;
      ASSERT_EQ(out[k], nan ? 0x7FC0 : static_cast<uint16_t>((in[k] + noise) >> 16)) << "value " << k;
    }
  }
}

INSTANTIATE_CPU_CAPABILITY_TEST_SUITE(RoundingKernelTest);

// O6's step widens bfloat16 weights, gradients and state to float32 a chunk
// at a time, and a tensor larger than a chunk in slices of it: stepping
// GPT-2's 50257 x 768 embedding (38.6M values) holds a few slices' float32
// copies above what the step leaves, not the whole tensor's (its weights,
// gradient, both moments and the noise: 770 MB), and the weights move.
TEST_F(AmpTest, TheWidenedStepOfALargeEmbeddingHoldsAFewSlices) {
  amp::track_allocations();
  torch::manual_seed(2);
  VectorModel model(torch::randn({50257, 768}) * 0.02);
  amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  Handle handle;
  handle.initialize(model, optimizer, o6());
  const at::Tensor before = model->w.detach().clone();
  optimizer.zero_grad();
  {
    scale_loss scaled(model->w.sum(), optimizer);  // a gradient of ones, in bfloat16
    scaled.backward();
  }
  reset_peak_allocated();
  optimizer.step();
  const AllocatedBytes bytes = allocated_bytes();
  std::printf("O6 AdamW step of a 50257 x 768 embedding: %.1f MiB above what it leaves\n",
              (bytes.peak - bytes.current) / 1048576.0);
  EXPECT_LT(bytes.peak - bytes.current, 32 << 20);
  EXPECT_TRUE((model->w < before).all().item<bool>()) << "Adam's first step moves every weight by about lr";
}

// The bf16 neighbour of float32 `exact` on the other side of `nearest`
// (its round-to-nearest bf16 value).
at::Tensor other_neighbour(const at::Tensor& exact, const at::Tensor& nearest) {
  const at::Tensor away = torch::logical_xor(exact > nearest, nearest < 0);  // step away from zero
  const at::Tensor bits = nearest.to(at::kBFloat16).view(at::kShort);
  return (bits + torch::where(away, 1, -1).to(at::kShort)).view(at::kBFloat16).to(at::kFloat);
}

TEST_F(AmpTest, OnCudaStochasticRoundingIsUnbiased) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  constexpr int64_t kN = 1 << 22;
  for (float fraction : {0.0371f, 0.5003f, 0.8867f}) {
    for (double start : {1.5, -1.5}) {
      torch::manual_seed(1);
      const auto [w, exact] = one_sgd_step(start, kUlp, fraction, kN, o6(), c10::kCUDA);
      EXPECT_TRUE(IsUnbiased(w, exact)) << fraction << " from " << start;
    }
  }
}

// Adam, AdamW and SGD with momentum, one step from the same bf16 weights and
// gradients: every rounded weight is one of the two bf16 neighbours of the
// same fused kernel's float32 step on float32 copies.
TEST_F(AmpTest, RoundedUpdatesBracketTheFloat32Step) {
  using Make = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;
  const std::vector<Make> makers = {
      [](auto p) { return std::make_unique<amp::optim::FusedAdamW>(p, torch::optim::AdamWOptions(1e-2).weight_decay(0.1)); },
      [](auto p) { return std::make_unique<amp::optim::FusedAdam>(p, torch::optim::AdamOptions(1e-2)); },
      [](auto p) { return std::make_unique<amp::optim::FusedSGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9)); },
  };
  for (size_t k = 0; k < makers.size(); ++k) {
    torch::manual_seed(2);
    VectorModel model(torch::randn({4096}));
    auto optimizer = makers[k](model->parameters());
    Handle handle;
    handle.initialize(model, *optimizer, o6());
    const at::Tensor start = model->w.detach().to(at::kFloat);
    const at::Tensor grad = torch::randn({4096}).to(at::kBFloat16).to(at::kFloat);  // exact in bf16
    {
      scale_loss scaled((model->w.to(at::kFloat) * grad).sum(), *optimizer);
      scaled.backward();
    }
    optimizer->step();
    // The reference: the same class outside amp, on float32 copies.
    VectorModelImpl reference(start.clone().requires_grad_());
    auto step = makers[k](reference.parameters());
    reference.w.mutable_grad() = grad.clone();
    step->step();
    const at::Tensor exact = reference.w.detach();
    const at::Tensor nearest = exact.to(at::kBFloat16).to(at::kFloat);
    const at::Tensor got = model->w.detach().to(at::kFloat);
    EXPECT_TRUE(torch::logical_or(got == nearest, got == other_neighbour(exact, nearest)).all().item<bool>()) << k;
    EXPECT_GT((got != nearest).sum().item<int64_t>(), 0) << k;  // some rounded away from nearest
  }
}

// Linear regression towards w* = 1.01 from w = 1 with updates of about a
// tenth of a bf16 ulp: rounding to nearest never moves the weights; the
// stochastic rounding trains them as float64 does, on average.
TEST_F(AmpTest, AModelThatStallsRoundingToNearestTrainsWithStochasticRounding) {
  auto train = [](bool stochastic) {
    torch::manual_seed(3);
    VectorModel model(torch::ones({512}));
    amp::optim::FusedSGD optimizer(model->parameters(), torch::optim::SGDOptions(0.02));
    Handle handle;
    handle.initialize(model, optimizer, o6([&](Options& o) { o.stochastic_rounding = stochastic; }));
    for (int step = 0; step < 300; ++step) {
      const at::Tensor x = torch::randn({16, 1});
      optimizer.zero_grad();
      // Each weight fits its own copy of the task: its gradient is 2 mean(x^2) (w - 1.01).
      const at::Tensor loss = (x * model->w.to(at::kFloat) - x * 1.01).pow(2).mean(0).sum();
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
    }
    return model->w.detach().to(at::kDouble);
  };
  const at::Tensor nearest = train(false), stochastic = train(true);
  // The same 300 steps in float64, on the same batches.
  torch::manual_seed(3);
  double exact = 1.0;
  for (int step = 0; step < 300; ++step) {
    const double mean_square = torch::randn({16, 1}).to(at::kDouble).pow(2).mean().item<double>();
    exact -= 0.02 * 2 * mean_square * (exact - 1.01);
  }
  EXPECT_NEAR(exact, 1.01, 1e-3);
  EXPECT_TRUE((nearest == 1.0).all().item<bool>()) << "rounding to nearest moved a weight";
  // The stochastic weights' mean follows float64, and every weight ends on
  // a bfloat16 neighbour of it (a weight left at 1.0 is farther than an ulp).
  EXPECT_NEAR(stochastic.mean().item<double>(), exact, 1e-3);
  EXPECT_LT((stochastic - exact).abs().max().item<double>(), kUlp);
}

// A small classifier with a BatchNorm kept in float32: Adam state in bfloat16
// by default (float32 on request), 8 bytes per bf16 parameter, the same
// bits from the same seed, others from another.
struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl()
      : fc1(register_module("fc1", torch::nn::Linear(16, 64))),
        norm(register_module("norm", torch::nn::BatchNorm1d(64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::gelu(norm(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d norm;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Classifier);

struct ClassifierRun {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> state;
  TrainingBytes bytes;
};

// `steps` steps of FusedAdamW from seed `seed`; `resume_at`: at that step
// save a checkpoint, rebuild everything in fresh objects (initialized with
// `resumed_with`, or `options`) and load it.
ClassifierRun train_classifier(uint64_t seed, int steps, const Options& options, int resume_at = -1,
                               const std::optional<Options>& resumed_with = std::nullopt) {
  torch::manual_seed(seed);
  auto model = std::make_shared<Classifier>();
  auto optimizer = std::make_shared<amp::optim::FusedAdamW>((*model)->parameters(), torch::optim::AdamWOptions(3e-3));
  auto handle = std::make_unique<Handle>();
  handle->initialize(*model, *optimizer, options);
  const std::string path = temp_path("o6_resume.pt");
  for (int step = 0; step < steps; ++step) {
    if (step == resume_at) {
      save_checkpoint(path, {*model}, {*optimizer});
      handle.reset();  // deinitialize; a fresh run loads the file
      torch::manual_seed(seed + 1000);
      model = std::make_shared<Classifier>();
      optimizer = std::make_shared<amp::optim::FusedAdamW>((*model)->parameters(), torch::optim::AdamWOptions(3e-3));
      handle = std::make_unique<Handle>();
      handle->initialize(*model, *optimizer, resumed_with.value_or(options));
      load_checkpoint(path, {*model}, {*optimizer});
      std::remove(path.c_str());
    }
    torch::manual_seed(seed * 100 + step);  // the data, the same for every run
    const at::Tensor x = torch::randn({32, 16}), y = torch::randint(0, 4, {32});
    optimizer->zero_grad();
    const at::Tensor loss = torch::cross_entropy_loss((*model)->forward(x), y);
    {
      scale_loss scaled(loss, *optimizer);
      scaled.backward();
    }
    optimizer->step();
  }
  ClassifierRun run;
  for (const auto& p : (*model)->parameters()) run.params.push_back(p.detach().clone());
  for (const auto& p : (*model)->parameters()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*optimizer->state().at(p.unsafeGetTensorImpl()));
    run.state.insert(run.state.end(), {torch::tensor(s.step()), s.exp_avg(), s.exp_avg_sq()});
  }
  run.bytes = training_bytes(*optimizer);
  return run;
}

TEST_F(AmpTest, MastersFreeTrainingIsReproducibleAndResumesBitForBit) {
  const ClassifierRun a = train_classifier(7, 6, o6()), b = train_classifier(7, 6, o6());
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(BitEqual(a.params[i], b.params[i])) << i;
  EXPECT_EQ(a.params[0].scalar_type(), at::kBFloat16);
  EXPECT_EQ(a.params[2].scalar_type(), at::kFloat);  // BatchNorm's weight, kept float32
  const ClassifierRun resumed = train_classifier(7, 6, o6(), /*resume_at=*/3);
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(BitEqual(a.params[i], resumed.params[i])) << i;
  for (size_t i = 0; i < a.state.size(); ++i) EXPECT_TRUE(BitEqual(a.state[i], resumed.state[i])) << i;
}

TEST_F(AmpTest, MastersFreeTrainingWithFloat32StateResumesBitForBit) {
  const Options fp32_state = o6([](Options& o) { o.optimizer_state_dtype = at::kFloat; });
  const ClassifierRun a = train_classifier(8, 6, fp32_state), resumed = train_classifier(8, 6, fp32_state, 3);
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(BitEqual(a.params[i], resumed.params[i])) << i;
  for (size_t i = 0; i < a.state.size(); ++i) EXPECT_TRUE(BitEqual(a.state[i], resumed.state[i])) << i;
  EXPECT_EQ(resumed.state[1].scalar_type(), at::kFloat);
}

// A checkpoint holds the state as it was kept; loading it into a run with
// another optimizer_state_dtype converts it to that run's dtype.
TEST_F(AmpTest, MastersFreeStateLoadsIntoEitherStateDtype) {
  const Options bf16_state = o6(), fp32_state = o6([](Options& o) { o.optimizer_state_dtype = at::kFloat; });
  const ClassifierRun widened = train_classifier(8, 4, bf16_state, 3, fp32_state);
  const ClassifierRun narrowed = train_classifier(8, 4, fp32_state, 3, bf16_state);
  EXPECT_EQ(widened.state[1].scalar_type(), at::kFloat);
  EXPECT_EQ(narrowed.state[1].scalar_type(), at::kBFloat16);
  EXPECT_EQ(widened.params[0].scalar_type(), at::kBFloat16);
  EXPECT_EQ(narrowed.params[0].scalar_type(), at::kBFloat16);
}

TEST_F(AmpTest, MastersFreeStateDtypeAndBytesPerParameter) {
  const ClassifierRun bf16_state = train_classifier(9, 2, o6());
  const ClassifierRun fp32_state = train_classifier(9, 2, o6([](Options& o) { o.optimizer_state_dtype = at::kFloat; }));
  EXPECT_EQ(bf16_state.state[1].scalar_type(), at::kBFloat16);  // fc1.weight's exp_avg
  EXPECT_EQ(fp32_state.state[1].scalar_type(), at::kFloat);
  // fc1, fc2 in bf16 (weights 2, gradients 2, Adam's two moments 4 bytes);
  // BatchNorm's 128 float32 parameters 4 + 4 + 8.
  const int64_t low = 16 * 64 + 64 + 64 * 4 + 4, kept = 128;
  EXPECT_EQ(bf16_state.bytes.parameters, low + kept);
  EXPECT_EQ(bf16_state.bytes.masters + bf16_state.bytes.gradients + bf16_state.bytes.optimizer_state,
            8 * low + 16 * kept);
  EXPECT_EQ(fp32_state.bytes.optimizer_state, 8 * low + 8 * kept);
}

// amp's state carries the rounding's seed and count; a run without
// stochastic rounding, or an entry that is not two counts, refuses it and
// keeps its own state.
TEST_F(AmpTest, MastersFreeStateEntryIsChecked) {
  Classifier model;
  amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  std::stringstream saved;
  {
    Handle handle;
    handle.initialize(model, optimizer, o6());
    torch::serialize::OutputArchive archive;
    save_state(archive);
    archive.save_to(saved);
  }
  auto load = [&](const Options& options) {
    Handle handle;
    handle.initialize(model, optimizer, options);
    saved.clear();
    saved.seekg(0);
    torch::serialize::InputArchive archive;
    archive.load_from(saved);
    auto state_bytes = [] {
      torch::serialize::OutputArchive out;
      save_state(out);
      std::stringstream bytes;
      out.save_to(bytes);
      return bytes.str();
    };
    const std::string before = state_bytes();
    std::string error;
    try {
      load_state(archive);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
      EXPECT_EQ(state_bytes(), before) << "a refused load changed amp's state";
    }
    return error;
  };
  EXPECT_EQ(load(o6()), "");
  EXPECT_THAT(load(o6([](Options& o) { o.stochastic_rounding = false; })),
              ::testing::HasSubstr("stochastic rounding streams"));
  // An archive as save_state writes it, its rounding entry of the wrong shape.
  std::stringstream malformed;
  {
    Handle handle;
    handle.initialize(model, optimizer, o6());
    torch::serialize::OutputArchive archive, scaler(archive.compilation_unit());
    archive.write("opt_level", c10::IValue(std::string("O6")));
    archive.write("num_losses", at::scalar_tensor(int64_t{1}, at::kLong));
    loss_scaler(0)->save(scaler);
    archive.write("loss_scaler0", scaler);
    archive.write("stochastic_rounding", at::zeros({3}, at::kLong));
    archive.save_to(malformed);
  }
  saved.str(malformed.str());
  EXPECT_THAT(load(o6()), ::testing::HasSubstr("seed and step count"));
}

TEST_F(AmpTest, MastersFreeLevelRefusesLibTorchsOwnOptimizers) {
  Classifier model;
  torch::optim::AdamW own(model->parameters(), torch::optim::AdamWOptions(1e-3));
  EXPECT_AMP_ERROR(initialize(model, own, o6()), "Use amp::optim::FusedAdamW, FusedAdam or FusedSGD");
  EXPECT_FALSE(is_initialized());
  EXPECT_EQ(model->fc1->weight.scalar_type(), at::kFloat);  // nothing converted
  // Rounding to nearest is LibTorch's own step: allowed.
  Handle handle;
  handle.initialize(model, own, o6([](Options& o) { o.stochastic_rounding = false; }));
}

}  // namespace
}  // namespace amp::testing
