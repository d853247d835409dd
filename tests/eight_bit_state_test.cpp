// SPDX-License-Identifier: BSD-3-Clause
// 8-bit optimizer state (Options::optimizer_state_dtype = uint8): Adam's
// moments and SGD's momentum packed blockwise in amp's fused optimizers.
// The packing against a float64 reference, its rounding unbiased, a block
// packed again the same bytes; Adam's step from the unpacked state against
// float64; training at O2, O5 and O6 beside float32 state; skipped steps,
// checkpoints and the program's own torch::save; conversions either way;
// the bytes; the errors.
#include "test_util.h"

#include "cpu_capability.h"
#include "optim/eight_bit_state.h"
#include "optim/stochastic_rounding.h"
#include "optim/widened_step_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <sstream>

namespace amp::testing {
namespace {

// ---- The packing ----------------------------------------------------------------

// The code values as the header states them, in double.
std::vector<double> code_values(bool non_negative) {
  std::vector<double> codes{0.0};
  for (int k = 0; k < (non_negative ? 255 : 127); ++k) {
    const double magnitude = static_cast<float>(std::exp2(-k / (non_negative ? 4.0 : 8.0)));
    codes.push_back(magnitude);
    if (!non_negative) codes.push_back(-magnitude);
  }
  return codes;
}

// Each value rounded to the nearest code of its block, scaled by the
// smallest power of two holding the block's maximum: in float64, from the
// header's definition.
at::Tensor reference_nearest(const at::Tensor& values, bool non_negative) {
  const std::vector<double> codes = code_values(non_negative);
  const at::Tensor x = values.to(at::kDouble).contiguous();
  at::Tensor out = at::empty_like(x);
  const double* in = x.data_ptr<double>();
  double* o = out.data_ptr<double>();
  for (int64_t begin = 0; begin < x.numel(); begin += detail::kStateBlock) {
    const int64_t end = std::min(x.numel(), begin + detail::kStateBlock);
    double absmax = 0;
    for (int64_t i = begin; i < end; ++i) absmax = std::max(absmax, std::abs(in[i]));
    int exponent = 0;
    const double mantissa = std::frexp(absmax, &exponent);
    const double scale = std::ldexp(1.0, mantissa == 0.5 ? exponent - 1 : exponent);
    for (int64_t i = begin; i < end; ++i) {
      double best = codes[0];
      for (double c : codes) {
        if (std::abs(in[i] / scale - c) < std::abs(in[i] / scale - best)) best = c;
      }
      o[i] = best * scale;
    }
  }
  return out.to(at::kFloat);
}

// Values over many orders of magnitude, signed or not: 1000 of them (three
// whole blocks and a part).
at::Tensor wide_values(bool non_negative, uint64_t seed) {
  torch::manual_seed(seed);
  const at::Tensor x = torch::randn({1000}) * torch::exp(torch::randn({1000}) * 3);
  return non_negative ? x * x : x;
}

TEST(EightBitStateTest, PackingToNearestMatchesAFloat64Reference) {
  for (const bool non_negative : {false, true}) {
    const at::Tensor values = wide_values(non_negative, 1);
    const at::Tensor packed = detail::pack_state(values, non_negative, nullptr);
    EXPECT_EQ(packed.scalar_type(), at::kByte);
    EXPECT_EQ(packed.sizes(), (at::IntArrayRef{4, detail::kPackedRow}));
    const at::Tensor unpacked = detail::unpack_state(packed, {1000}, non_negative);
    EXPECT_TRUE(BitEqual(unpacked, reference_nearest(values, non_negative))) << non_negative;
    // Within half a code step of each value the codes reach (9% apart
    // signed, 19% non-negative): (r - 1) / (r + 1) of it.
    const double r = std::exp2(non_negative ? 0.25 : 0.125), bound = (r - 1) / (r + 1) + 1e-6;
    // (the smallest code is 2^-15.75 or 2^-63.5 of a scale below twice the maximum).
    const at::Tensor reached = values.abs() >= unpacked.abs().max() * std::exp2(non_negative ? -62.0 : -14.5);
    const at::Tensor relative = ((unpacked - values).abs() / values.abs()).masked_select(reached);
    EXPECT_LE(relative.max().item<double>(), bound) << non_negative;
  }
}

// Between its two neighbouring codes a value goes up with probability
// (y - a) / (b - a): a million draws average to it within 5 standard
// errors, where rounding to nearest is off by 40 of them.
TEST(EightBitStateTest, StochasticPackingIsUnbiased) {
  detail::StochasticRounding rounder(/*seed=*/5, /*stream=*/0);
  const detail::RoundingKey key{rounder.next_step(), 0};
  for (const bool non_negative : {false, true}) {
    const int64_t blocks = 4096;
    at::Tensor values = torch::full({blocks, detail::kStateBlock}, 0.3f);
    values.select(1, 0).fill_(1.0f);  // each block's maximum: its scale is 1
    const at::Tensor unpacked =
        detail::unpack_state(detail::pack_state(values.view(-1), non_negative, &rounder, key), values.sizes(), non_negative)
            .narrow(1, 1, detail::kStateBlock - 1);
    const double a = std::exp2(-(non_negative ? 7 : 14) / (non_negative ? 4.0 : 8.0));  // the code below 0.3
    const double b = std::exp2(-(non_negative ? 6 : 13) / (non_negative ? 4.0 : 8.0));
    ASSERT_LT(a, 0.3);
    ASSERT_GT(b, 0.3);
    EXPECT_TRUE(((unpacked - static_cast<float>(a)).abs() < 1e-6).logical_or((unpacked - static_cast<float>(b)).abs() < 1e-6).all().item<bool>());
    const double p = (0.3 - a) / (b - a), error = (b - a) * std::sqrt(p * (1 - p) / unpacked.numel());
    EXPECT_NEAR(unpacked.mean().item<double>(), 0.3, 5 * error) << non_negative;
    EXPECT_GT(std::min(0.3 - a, b - 0.3), 40 * error);  // nearest would fail the bound above
  }
}

// The code values just below and above y (a value over its block's scale).
std::pair<double, double> neighbouring_codes(double y, bool non_negative) {
  std::vector<double> codes = code_values(non_negative);
  std::sort(codes.begin(), codes.end());
  const auto above = std::lower_bound(codes.begin(), codes.end(), y);
  return {*std::prev(std::upper_bound(codes.begin(), codes.end(), y)), *above};
}

// Random values at random places between their codes, in blocks of random
// scales (2^-100 to 2^100) and both signs: each case's 255 x 256 draws
// average to its value within 5 standard errors. Rounding to nearest fails
// the same bound, so the check can tell.
TEST(EightBitStateTest, StochasticPackingIsUnbiasedOverRandomValuesAndScales) {
  constexpr int64_t kCases = 48, kBlocksPerCase = 256;
  detail::StochasticRounding rounder(/*seed=*/11, /*stream=*/0);
  std::mt19937 draw(2026);
  for (const bool non_negative : {false, true}) {
    std::vector<double> value(kCases), scale(kCases);
    at::Tensor blocks = torch::empty({kCases, kBlocksPerCase, detail::kStateBlock});
    for (int64_t c = 0; c < kCases; ++c) {
      scale[c] = std::ldexp(1.0, std::uniform_int_distribution<int>(-100, 100)(draw));
      // |y| from 2^-12 to 1, uniform in its exponent: every part of the code table.
      const double magnitude = std::exp2(-12.0 * std::uniform_real_distribution<double>(0, 1)(draw));
      const bool negative = !non_negative && std::bernoulli_distribution(0.5)(draw);
      value[c] = static_cast<float>((negative ? -magnitude : magnitude) * scale[c]);
      blocks[c].fill_(value[c]);
      blocks[c].select(1, 0).fill_(scale[c]);  // each block's maximum: its scale is scale[c]
    }
    const at::Tensor values = blocks.view(-1);
    const auto unpacked = [&](detail::StochasticRounding* r) {
      const at::Tensor packed = detail::pack_state(values, non_negative, r, {r ? r->next_step() : 0, 0});
      return detail::unpack_state(packed, blocks.sizes(), non_negative).narrow(2, 1, detail::kStateBlock - 1);
    };
    const at::Tensor stochastic = unpacked(&rounder).to(at::kDouble), nearest = unpacked(nullptr).to(at::kDouble);
    int nearest_caught = 0;
    for (int64_t c = 0; c < kCases; ++c) {
      SCOPED_TRACE("case " + std::to_string(c) + ": " + std::to_string(value[c]) + " in blocks of scale " +
                   std::to_string(scale[c]) + (non_negative ? ", non-negative" : ", signed"));
      const auto [a, b] = neighbouring_codes(value[c] / scale[c], non_negative);
      const double y = value[c] / scale[c], p = (y - a) / (b - a);
      const at::Tensor drawn = stochastic[c] / scale[c];
      EXPECT_TRUE(((drawn - a).abs() < 1e-7 * std::abs(a) + 1e-300).logical_or((drawn - b).abs() < 1e-7 * std::abs(b))
                      .all().item<bool>()) << "every draw is one of the two codes around the value";
      const double error = (b - a) * std::sqrt(std::max(p * (1 - p), 1e-12) / drawn.numel());
      EXPECT_NEAR(drawn.mean().item<double>(), y, 5 * error);
      nearest_caught += std::abs((nearest[c] / scale[c]).mean().item<double>() - y) > 5 * error;
    }
    EXPECT_GE(nearest_caught, kCases * 3 / 4) << "rounding to nearest passed most cases: the bound is too loose";
  }
}

// Unpacked and packed again - to nearest or stochastically, with any
// noise - a block is the same bytes: values on codes stay on them, and a
// block whose maximum rounded down onto 0.5 is coded one exponent down.
TEST(EightBitStateTest, APackedBlockPackedAgainIsTheSameBytes) {
  detail::StochasticRounding rounder(7, 0);
  for (const bool non_negative : {false, true}) {
    at::Tensor values = wide_values(non_negative, 2);
    values.narrow(0, 0, detail::kStateBlock).fill_(0.52f);  // rounds down onto 0.5 (to nearest)
    const at::Tensor nearest = detail::pack_state(values, non_negative, nullptr);
    EXPECT_EQ(static_cast<int8_t>(nearest[0][detail::kStateBlock].item<uint8_t>()), -1);  // 2^-1: codes of 1.0
    EXPECT_TRUE(BitEqual(detail::unpack_state(nearest, {1000}, non_negative).narrow(0, 0, 4), torch::full({4}, 0.5f)));
    const at::Tensor stochastic = detail::pack_state(values, non_negative, &rounder, {rounder.next_step(), 0});
    for (const at::Tensor& packed : {nearest, stochastic}) {
      const at::Tensor unpacked = detail::unpack_state(packed, {1000}, non_negative);
      EXPECT_TRUE(BitEqual(detail::pack_state(unpacked, non_negative, &rounder, {rounder.next_step(), 0}), packed))
          << non_negative;
      EXPECT_TRUE(BitEqual(detail::pack_state(unpacked, non_negative, nullptr), packed)) << non_negative;
    }
    // Zeros packed are packed_zeros' bytes (a fresh state's, made without float32 values).
    EXPECT_TRUE(BitEqual(detail::packed_zeros(1000, non_negative, {}),
                         detail::pack_state(torch::zeros({1000}), non_negative, &rounder, {rounder.next_step(), 0})));
  }
}

// Blocks that reach each branch of the coding: values over every scale,
// a zero block, one whose maximum is on a code, one whose maximum rounds
// down onto 0.5 (recoded one exponent down: to nearest always, with noise
// in about half of 64 such blocks), inf and NaN, scales clamped at 2^-126
// and 2^127, subnormals, negative zeros, a last block in part.
at::Tensor coding_cases(bool non_negative) {
  torch::manual_seed(5);
  const auto block = [](const at::Tensor& v) { return v.reshape(-1).narrow(0, 0, detail::kStateBlock); };
  at::Tensor onto_half = torch::rand({64, detail::kStateBlock}) * 0.5f;
  onto_half.select(1, 3).fill_(0.51f);
  std::vector<at::Tensor> parts = {
      wide_values(non_negative, 4),                                               // blocks 0-3
      torch::zeros({detail::kStateBlock + 24}),                                   // 3's end, 4
      block(torch::randn({detail::kStateBlock}).clamp(-0.2, 0.2).index_put_({7}, 0.25f)),  // 5: its maximum is 1's code
      block(torch::rand({detail::kStateBlock}) * 0.5f).index_put_({9}, 0.52f),  // 6: onto 0.5
      onto_half.reshape(-1) * std::exp2(-3.0f),
      torch::randn({detail::kStateBlock}).index_put_({5}, std::numeric_limits<float>::infinity()),
      torch::randn({detail::kStateBlock}).index_put_({200}, std::numeric_limits<float>::quiet_NaN()),
      torch::randn({detail::kStateBlock}) * 1e-39f,                                // subnormal, scale clamped
      torch::randn({detail::kStateBlock}) * 1e-44f,
      torch::randn({detail::kStateBlock}).clamp(-1, 1) * 3.4e38f,               // scale clamped at 2^127
      torch::full({detail::kStateBlock}, -0.0f).index_put_({0}, 1.0f),
      torch::randn({77}) * torch::exp(torch::randn({77}) * 5),
  };
  const at::Tensor values = torch::cat(parts);
  return non_negative ? values.abs() : values;
}

// On the CPU a block is coded, and decoded, in one pass: the same bytes,
// and the same float32 values, as the ATen ops (CUDA's path) - to nearest
// and stochastically from the same stream.
TEST(EightBitStateTest, TheOnePassCodingIsTheAtenOpsBytes) {
  for (bool non_negative : {false, true}) {
    SCOPED_TRACE(non_negative ? "non-negative" : "signed");
    const at::Tensor values = coding_cases(non_negative);
    for (bool stochastic : {false, true}) {
      SCOPED_TRACE(stochastic ? "stochastic" : "to nearest");
      const auto pack = [&](detail::CpuPath path) {
        detail::StochasticRounding rounder(/*seed=*/11, /*stream=*/2, /*weights=*/false);
        return detail::pack_state(values, non_negative, stochastic ? &rounder : nullptr, {3, 4, 1}, path);
      };
      const at::Tensor one_pass = pack(detail::CpuPath::kOnePass), aten = pack(detail::CpuPath::kAtenOps);
      EXPECT_TRUE(BitEqual(one_pass, aten));
      EXPECT_TRUE(BitEqual(detail::unpack_state(one_pass, values.sizes(), non_negative, detail::CpuPath::kOnePass),
                           detail::unpack_state(aten, values.sizes(), non_negative, detail::CpuPath::kAtenOps)));
    }
    // The recoded blocks were reached (their exponent one below their maximum's).
    const at::Tensor nearest = detail::pack_state(values, non_negative, nullptr);
    EXPECT_EQ(nearest[6][detail::kStateBlock].item<uint8_t>(),
              static_cast<uint8_t>(static_cast<int8_t>(-1))) << "0.52's block, to nearest";
    // Any bytes decode alike: random codes and exponents, -128 (non-finite) among them.
    torch::manual_seed(6);
    at::Tensor bytes = torch::randint(0, 256, {40, detail::kPackedRow}, at::kByte);
    if (!non_negative) bytes.narrow(1, 0, detail::kStateBlock).clamp_max_(254);
    bytes.narrow(1, detail::kStateBlock, 1).view(at::kChar).clamp_min_(-126).index_put_({3}, -128);
    const at::Tensor unpacked = detail::unpack_state(bytes, {40 * 256 - 100}, non_negative, detail::CpuPath::kAtenOps);
    EXPECT_TRUE(BitEqual(detail::unpack_state(bytes, {40 * 256 - 100}, non_negative, detail::CpuPath::kOnePass),
                         unpacked));
    // Into a piece of a larger buffer (the step's chunk), by either path: the same values, and nothing else written.
    for (const detail::CpuPath path : {detail::CpuPath::kOnePass, detail::CpuPath::kAtenOps}) {
      const at::Tensor buffer = torch::full({3 + 40 * 256 - 100 + 5}, 7.0f);
      detail::unpack_state_into(bytes, buffer.narrow(0, 3, 40 * 256 - 100), non_negative, path);
      EXPECT_TRUE(BitEqual(buffer.narrow(0, 3, 40 * 256 - 100), unpacked));
      EXPECT_TRUE(buffer.narrow(0, 0, 3).eq(7).all().item<bool>() && buffer.narrow(0, 3 + 40 * 256 - 100, 5).eq(7).all().item<bool>());
    }
  }
}

// Values on each code, one float32 step either side of it, and on and
// beside each midpoint between neighbouring codes, in blocks whose
// maximum is 1 (the codes unscaled) and 2^-40: where the coding's guess of
// a value's code from its logarithm is corrected by one code either way,
// and where rounding to nearest ties.
at::Tensor code_boundaries(bool non_negative) {
  std::vector<float> values;
  const std::vector<double> codes = code_values(non_negative);
  std::vector<float> sorted(codes.begin(), codes.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const float c = sorted[i];
    for (const float v : {c, std::nextafter(c, -2.0f), std::nextafter(c, 2.0f)}) values.push_back(v);
    if (i + 1 < sorted.size()) {
      const float mid = (c + sorted[i + 1]) / 2;
      for (const float v : {mid, std::nextafter(mid, -2.0f), std::nextafter(mid, 2.0f)}) values.push_back(v);
    }
  }
  at::Tensor v = torch::tensor(values).clamp(non_negative ? 0.0 : -1.0, 1.0);
  const int64_t per_block = detail::kStateBlock - 1, blocks = (v.numel() + per_block - 1) / per_block;
  v = torch::cat({v, torch::zeros({blocks * per_block - v.numel()})}).view({blocks, per_block});
  const at::Tensor unit = torch::cat({torch::ones({blocks, 1}), v}, 1).view(-1);  // each block's maximum 1
  return torch::cat({unit, unit * std::exp2(-40.0f)});
}

// On CUDA a chunk's packed state is coded by amp's kernel, many tensors a
// launch (a launch takes 444: here two), drawing what at::rand draws for
// each tensor's padded rows: the ATen ops' bytes for the coding's cases
// (recoded, non-finite and clamped blocks, a short last block), code
// boundaries, and random lengths - to nearest and stochastically; and
// decoded by another, to the ATen ops' values. Builds with amp's CUDA
// kernels must take them.
TEST(EightBitStateTest, OnCudaTheCodingKernelsAreTheAtenOps) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
#ifdef AMP_TEST_CUDA_KERNELS
  EXPECT_TRUE(detail::widened_step_kernels_apply(torch::ones({1}, torch::kCUDA)));
#else
  GTEST_SKIP() << "this build has no CUDA kernels (no CUDA compiler): ATen ops code the state";
#endif
  for (bool stochastic : {false, true}) {
    SCOPED_TRACE(stochastic ? "stochastic" : "to nearest");
    detail::StochasticRounding rounder(/*seed=*/11, /*stream=*/2, /*weights=*/false);
    std::vector<detail::StatePacking> kernel, aten;
    torch::manual_seed(8);
    for (int64_t i = 0; i < 460; ++i) {
      const bool non_negative = i % 2 == 1;
      at::Tensor values = i < 2 ? coding_cases(non_negative) : i < 4 ? code_boundaries(non_negative)
                                                             : torch::randn({1 + 37 * (i % 50)}) * torch::exp(torch::randn({1}) * 4);
      if (non_negative) values = values.abs();
      values = values.cuda();
      const at::Tensor packed = detail::packed_zeros(values.numel(), non_negative, values.options());
      kernel.push_back({values, packed, non_negative, {3, static_cast<uint64_t>(i), 1}});
      aten.push_back({values, packed.clone(), non_negative, {3, static_cast<uint64_t>(i), 1}});
    }
    detail::pack_states_into(kernel, stochastic ? &rounder : nullptr);
    for (size_t i = 0; i < aten.size(); ++i) {
      detail::pack_state_into(aten[i].values, aten[i].packed, aten[i].non_negative, stochastic ? &rounder : nullptr,
                              aten[i].key, detail::CpuPath::kAtenOps);
      EXPECT_TRUE(BitEqual(kernel[i].packed.cpu(), aten[i].packed.cpu())) << "tensor " << i;
    }
  }
  // Decoding, many tensors a launch (666: here one): the ATen ops' values
  // for any bytes (random codes and exponents, -128 - non-finite - and -127
  // among them), into pieces of one buffer as a step's chunk takes them.
  torch::manual_seed(9);
  std::vector<detail::StateUnpacking> kernel;
  std::vector<at::Tensor> expected;
  const at::Tensor buffer = torch::full({50 * 3000}, 7.0f, torch::kCUDA);
  int64_t offset = 0;
  for (int64_t i = 0; i < 50; ++i) {
    const bool non_negative = i % 2 == 0;
    const int64_t numel = 1 + 59 * i, rows = detail::packed_blocks(numel);
    at::Tensor bytes = torch::randint(0, 256, {rows, detail::kPackedRow}, at::kByte);
    if (!non_negative) bytes.narrow(1, 0, detail::kStateBlock).clamp_max_(254);
    at::Tensor exponents = bytes.narrow(1, detail::kStateBlock, 1).view(at::kChar);
    exponents.index_put_({0}, i % 3 == 0 ? -128 : -127);
    bytes = bytes.cuda();
    const at::Tensor values = buffer.narrow(0, offset, numel);
    offset += numel;
    kernel.push_back({bytes, values, non_negative});
    expected.push_back(torch::empty({numel}, torch::kCUDA));
    detail::unpack_state_into(bytes, expected.back(), non_negative, detail::CpuPath::kAtenOps);
  }
  detail::unpack_states_into(kernel);
  for (size_t i = 0; i < kernel.size(); ++i) {
    EXPECT_TRUE(BitEqual(kernel[i].values.cpu(), expected[i].cpu())) << "tensor " << i;
  }
  EXPECT_TRUE(buffer.narrow(0, offset, buffer.numel() - offset).eq(7).all().item<bool>()) << "nothing else written";
}

// The block coding is compiled once per CPU capability
// (optim/one_pass_kernels.h); each that this CPU runs writes the ATen ops'
// bytes, to nearest and stochastically.
class BlockCodingKernelTest : public CpuCapabilityTest {};

TEST_P(BlockCodingKernelTest, WritesTheAtenOpsBytes) {
  const detail::CodeBlocksFn kernel = kernels().code_blocks;
  for (const bool non_negative : {false, true}) {
    SCOPED_TRACE(non_negative ? "non-negative" : "signed");
    torch::manual_seed(8);
    const at::Tensor random = torch::randn({300 * detail::kStateBlock + 17}) * torch::exp(torch::randn({1}) * 3) *
                              torch::exp2(torch::randint(-30, 30, {300 * detail::kStateBlock + 17}));
    at::Tensor values = torch::cat({coding_cases(non_negative), code_boundaries(non_negative),
                                    non_negative ? random.abs() : random});
    for (const bool stochastic : {false, true}) {
      SCOPED_TRACE(stochastic ? "stochastic" : "to nearest");
      detail::StochasticRounding by_kernel(/*seed=*/11, /*stream=*/2, /*weights=*/false), by_ops(11, 2, false);
      at::Tensor packed = torch::empty({detail::packed_blocks(values.numel()), detail::kPackedRow}, at::kByte);
      detail::pack_state_into_by(kernel, values, packed, non_negative, stochastic ? &by_kernel : nullptr, {3, 4, 1});
      const at::Tensor aten = detail::pack_state(values, non_negative, stochastic ? &by_ops : nullptr, {3, 4, 1},
                                                 detail::CpuPath::kAtenOps);
      EXPECT_TRUE(BitEqual(packed, aten));
    }
  }
}

// A sweep over float32: every 64th value from 2^-17 to 1 and its negative
// (signed), every 512th from 2^-66 to 1 (non-negative), in blocks whose
// maximum is 1 - each value coded as the ATen ops code it, to nearest and
// stochastically. (Every second value of the signed sweep and every 16th of
// the non-negative one were checked the same way once, in 8 s.)
TEST_P(BlockCodingKernelTest, ASweepOverFloat32CodesAsTheAtenOps) {
  for (const bool non_negative : {false, true}) {
    SCOPED_TRACE(non_negative ? "non-negative" : "signed");
    const int64_t first = non_negative ? 0x1E800000 : 0x37000000, stride = non_negative ? 512 : 64;
    at::Tensor y = torch::arange(first, 0x3F800000 + 1, stride, at::kInt).view(at::kFloat);
    if (!non_negative) y = torch::cat({y, y.neg()});
    const int64_t per_block = detail::kStateBlock - 1, blocks = (y.numel() + per_block - 1) / per_block;
    y = torch::cat({y, torch::zeros({blocks * per_block - y.numel()})}).view({blocks, per_block});
    const at::Tensor values = torch::cat({torch::ones({blocks, 1}), y}, 1).view(-1);
    for (const bool stochastic : {false, true}) {
      SCOPED_TRACE(stochastic ? "stochastic" : "to nearest");
      detail::StochasticRounding by_kernel(/*seed=*/5, /*stream=*/1, /*weights=*/false), by_ops(5, 1, false);
      at::Tensor packed = torch::empty({blocks, detail::kPackedRow}, at::kByte);
      detail::pack_state_into_by(kernels().code_blocks, values, packed, non_negative, stochastic ? &by_kernel : nullptr,
                                 {1, 2});
      const at::Tensor aten = detail::pack_state(values, non_negative, stochastic ? &by_ops : nullptr, {1, 2},
                                                 detail::CpuPath::kAtenOps);
      EXPECT_EQ(packed.ne(aten).sum().item<int64_t>(), 0);
    }
  }
}

INSTANTIATE_CPU_CAPABILITY_TEST_SUITE(BlockCodingKernelTest);

// The decoding too: each kernel this CPU runs reads the ATen ops' values
// (a non-finite block's NaNs, a last block short of 256 values among them),
// and finds a damaged code.
class BlockDecodingKernelTest : public CpuCapabilityTest {};

TEST_P(BlockDecodingKernelTest, ReadsTheAtenOpsValues) {
  for (const bool non_negative : {false, true}) {
    SCOPED_TRACE(non_negative ? "non-negative" : "signed");
    torch::manual_seed(9);
    at::Tensor values = torch::randn({40 * detail::kStateBlock + 100}) *
                        torch::exp2(torch::randint(-40, 40, {40 * detail::kStateBlock + 100}));
    if (non_negative) values = values.abs();
    values[3 * detail::kStateBlock + 7] = std::numeric_limits<float>::infinity();
    detail::StochasticRounding rounder(/*seed=*/2, /*stream=*/0, /*weights=*/false);
    const at::Tensor packed = detail::pack_state(values, non_negative, &rounder, {1, 1});
    const at::Tensor aten = detail::unpack_state(packed, values.sizes(), non_negative, detail::CpuPath::kAtenOps);
    at::Tensor decoded = torch::empty_like(values);
    detail::unpack_state_into_by(kernels().decode_blocks, packed, decoded, non_negative);
    EXPECT_TRUE(decoded.isnan().equal(aten.isnan()));
    EXPECT_EQ(decoded.isnan().sum().item<int64_t>(), detail::kStateBlock);
    EXPECT_TRUE(BitEqual(decoded.nan_to_num(0), aten.nan_to_num(0)));
  }
  // The signed code has 255 codes: a byte of 255 is damage, refused by index.
  torch::manual_seed(10);
  const at::Tensor packed = detail::pack_state(torch::randn({600}), /*non_negative=*/false, nullptr);
  packed[1][5] = 255;
  at::Tensor decoded = torch::empty({600});
  try {
    detail::unpack_state_into_by(kernels().decode_blocks, packed, decoded, false);
    ADD_FAILURE() << "a damaged code was decoded";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                ::testing::HasSubstr("holds code 255, which the signed code has not (0..254): the state is damaged"));
  }
}

INSTANTIATE_CPU_CAPABILITY_TEST_SUITE(BlockDecodingKernelTest);

// A block holding an inf or NaN has no scale: it unpacks as NaN in all
// its values, never as finite ones, whichever rounding packed it; the
// other blocks are as without it, and the block packs again into the same
// bytes.
TEST(EightBitStateTest, ANonFiniteValueKeepsItsBlockNonFinite) {
  detail::StochasticRounding rounder(9, 0);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (const bool non_negative : {false, true}) {
    const at::Tensor clean = wide_values(non_negative, 3);  // 1000 values: blocks 0-3
    for (const float bad : {inf, -inf, nan}) {
      if (non_negative && bad < 0) continue;
      SCOPED_TRACE(std::to_string(bad) + (non_negative ? ", non-negative" : ", signed"));
      at::Tensor values = clean.clone();
      values[300] = bad;  // block 1
      for (detail::StochasticRounding* r : {static_cast<detail::StochasticRounding*>(nullptr), &rounder}) {
        const detail::RoundingKey key{r ? r->next_step() : 0, 0};
        const at::Tensor packed = detail::pack_state(values, non_negative, r, key);
        const at::Tensor unpacked = detail::unpack_state(packed, {1000}, non_negative);
        EXPECT_TRUE(unpacked.narrow(0, 256, 256).isnan().all().item<bool>()) << "the block is NaN";
        EXPECT_EQ(static_cast<int8_t>(packed[1][detail::kStateBlock].item<uint8_t>()), -128);
        const at::Tensor others = at::cat({unpacked.narrow(0, 0, 256), unpacked.narrow(0, 512, 488)});
        EXPECT_TRUE(others.isfinite().all().item<bool>());
        if (r == nullptr) {
          const at::Tensor expected = detail::unpack_state(detail::pack_state(clean, non_negative, nullptr), {1000},
                                                           non_negative);
          EXPECT_TRUE(BitEqual(others, at::cat({expected.narrow(0, 0, 256), expected.narrow(0, 512, 488)})));
        }
        EXPECT_TRUE(BitEqual(detail::pack_state(unpacked, non_negative, nullptr), packed));
      }
    }
  }
}

// ---- Training ----------------------------------------------------------------

// One parameter vector.
struct VectorImpl : torch::nn::Module {
  explicit VectorImpl(at::Tensor init) : w(register_parameter("w", std::move(init))) {}
  at::Tensor w;
};
TORCH_MODULE(Vector);

Options with_state(Options options, std::optional<at::ScalarType> dtype) {
  options.verbosity = 0;
  options.optimizer_state_dtype = dtype;
  return options;
}

// A classifier whose 9,000 parameters span whole and partial blocks, with a
// BatchNorm kept in float32; the labels come from a fixed teacher, so the
// loss can fall.
struct StudentImpl : torch::nn::Module {
  StudentImpl()
      : fc1(register_module("fc1", torch::nn::Linear(16, 300))),
        norm(register_module("norm", torch::nn::BatchNorm1d(300))),
        fc2(register_module("fc2", torch::nn::Linear(300, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::gelu(norm(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d norm;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Student);

std::pair<at::Tensor, at::Tensor> student_batch(int step) {
  torch::manual_seed(1000 + step);
  const at::Tensor x = torch::randn({64, 16});
  torch::manual_seed(99);
  const at::Tensor teacher = torch::randn({16, 4});
  return {x, x.matmul(teacher).argmax(1)};
}

enum class Kind { kAdamW, kSgd };

std::shared_ptr<torch::optim::Optimizer> make_optimizer(Kind kind, Student& model) {
  if (kind == Kind::kSgd) {
    return std::make_shared<amp::optim::FusedSGD>(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_shared<amp::optim::FusedAdamW>(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
}

struct TrainedRun {
  std::vector<at::Tensor> params, state;  // the state as it is kept (packed or not)
  std::vector<double> losses;
  TrainingBytes bytes;
};

// The state tensors of every parameter, as kept.
std::vector<at::Tensor> state_of(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    auto it = optimizer.state().find(p.unsafeGetTensorImpl());
    if (it == optimizer.state().end()) continue;
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      out.insert(out.end(), {torch::tensor(s->step()), s->exp_avg(), s->exp_avg_sq()});
    } else {
      out.push_back(static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer());
    }
  }
  return out;
}

// `steps` steps from seed 0; `resume_at`: there amp::save_checkpoint, a
// fresh model, optimizer and initialize (with `resumed_with`, or
// `options`), amp::load_checkpoint; `save_to`: a checkpoint at the end.
TrainedRun train(const Options& options, int steps, Kind kind = Kind::kAdamW, int resume_at = -1,
          const std::optional<Options>& resumed_with = std::nullopt, const std::string& save_to = "") {
  torch::manual_seed(0);
  auto model = std::make_shared<Student>();
  auto optimizer = make_optimizer(kind, *model);
  auto handle = std::make_unique<Handle>();
  handle->initialize(*model, *optimizer, options);
  const std::string path = temp_path("eight_bit_resume.pt");
  TrainedRun run;
  for (int step = 0; step < steps; ++step) {
    if (step == resume_at) {
      save_checkpoint(path, {*model}, {*optimizer});
      handle.reset();
      torch::manual_seed(1);
      model = std::make_shared<Student>();
      optimizer = make_optimizer(kind, *model);
      handle = std::make_unique<Handle>();
      handle->initialize(*model, *optimizer, resumed_with.value_or(options));
      load_checkpoint(path, {*model}, {*optimizer});
      std::remove(path.c_str());
    }
    const auto [x, y] = student_batch(step);
    optimizer->zero_grad();
    const at::Tensor loss = torch::cross_entropy_loss((*model)->forward(x), y);
    {
      scale_loss scaled(loss, *optimizer);
      scaled.backward();
    }
    optimizer->step();
    run.losses.push_back(loss.item<double>());
  }
  if (!save_to.empty()) save_checkpoint(save_to, {*model}, {*optimizer});
  run.params = clones((*model)->parameters());
  run.state = clones(state_of(*optimizer, (*model)->parameters()));
  run.bytes = training_bytes(*optimizer);
  return run;
}

double mean_of_last(const std::vector<double>& losses, size_t n) {
  double sum = 0;
  for (size_t i = losses.size() - n; i < losses.size(); ++i) sum += losses[i];
  return sum / static_cast<double>(n);
}

// At O2, O5 and O6, with AdamW and SGD's momentum, the state is packed (one
// uint8 [blocks, 257] tensor per moment) and training follows the float32
// state's (O6: bfloat16's) run closely; every run learns.
TEST_F(AmpTest, EightBitStateTrainsAsFloatStateDoesAtEveryLevel) {
  for (const OptLevel level : {O2, O5, O6}) {
    for (const Kind kind : {Kind::kAdamW, Kind::kSgd}) {
      SCOPED_TRACE(std::string(to_string(level)) + (kind == Kind::kSgd ? " SGD" : " AdamW"));
      const TrainedRun packed = train(with_state(level, at::kByte), 40, kind);
      const TrainedRun unpacked = train(with_state(level, std::nullopt), 40, kind);
      EXPECT_TRUE(detail::is_packed_state(packed.state[kind == Kind::kSgd ? 0 : 1]));  // fc1.weight's
      const double first = mean_of_last(std::vector<double>(packed.losses.begin(), packed.losses.begin() + 5), 5);
      const double last = mean_of_last(packed.losses, 5), reference = mean_of_last(unpacked.losses, 5);
      EXPECT_LT(last, 0.6 * first);
      EXPECT_NEAR(last, reference, 0.05 * reference);
    }
  }
}

// Adam's step from the state as amp unpacks it, computed in float64: the
// weights within float32 rounding of it, each moment one of the two codes
// around the exact update (within a code step of it).
TEST_F(AmpTest, EightBitAdamStepsFromTheUnpackedStateAsFloat64Does) {
  torch::manual_seed(3);
  const int64_t n = 4600;  // 17 whole blocks and a part
  Vector holder(torch::randn({n}));
  const at::Tensor& w = holder->w;
  const double lr = 1e-2, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, decay = 0.01;
  amp::optim::FusedAdamW optimizer({w}, torch::optim::AdamWOptions(lr).weight_decay(decay));
  Handle handle;
  handle.initialize(holder, optimizer, with_state(O0, at::kByte));
  at::Tensor m = torch::zeros({n}, at::kDouble), v = torch::zeros({n}, at::kDouble);
  for (int step = 1; step <= 6; ++step) {
    const at::Tensor g = torch::randn({n}) * std::pow(10.0, -step);  // moments over decades
    const at::Tensor w0 = w.detach().to(at::kDouble);
    optimizer.zero_grad();
    {
      scale_loss scaled((w * g).sum(), optimizer);
      scaled.backward();
    }
    optimizer.step();
    const at::Tensor g64 = g.to(at::kDouble);
    const at::Tensor m_exact = beta1 * m + (1 - beta1) * g64, v_exact = beta2 * v + (1 - beta2) * g64 * g64;
    const double c1 = 1 - std::pow(beta1, step), c2 = 1 - std::pow(beta2, step);
    const at::Tensor w_exact = w0 * (1 - lr * decay) - lr * (m_exact / c1) / ((v_exact / c2).sqrt() + eps);
    EXPECT_LE((w.detach().to(at::kDouble) - w_exact).abs().max().item<double>(), 2e-6) << step;
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*optimizer.state().at(w.unsafeGetTensorImpl()));
    m = detail::unpack_state(s.exp_avg(), {n}, false).to(at::kDouble);
    v = detail::unpack_state(s.exp_avg_sq(), {n}, true).to(at::kDouble);
    // Below 2^-15.75 of its block's maximum a first moment is 0 or the
    // smallest code.
    const at::Tensor block_max = at::constant_pad_nd(m_exact.abs(), {0, 18 * 256 - n}).view({18, 256}).amax(1)
                                     .repeat_interleave(256).narrow(0, 0, n);
    const at::Tensor slack = 2 * std::exp2(-15.75) * block_max;
    EXPECT_TRUE(((m - m_exact).abs() <= (std::exp2(0.125) - 1 + 1e-5) * m_exact.abs() + slack).all().item<bool>()) << step;
    EXPECT_LE(((v - v_exact).abs() / v_exact).max().item<double>(), std::exp2(0.25) - 1 + 1e-5) << step;
  }
}

// With zero gradients the second moment decays by beta2 = 0.999 a step, a
// thousandth of a value where its codes are 19% apart: rounded to nearest
// it would never move; rounded stochastically it decays on average as the
// exact one does.
TEST_F(AmpTest, EightBitSecondMomentDecaysWhereNearestRoundingWouldFreezeIt) {
  Vector holder(torch::zeros({64 * 256}));
  const at::Tensor& w = holder->w;
  amp::optim::FusedAdam optimizer({w}, torch::optim::AdamOptions(1e-3));
  Handle handle;
  handle.initialize(holder, optimizer, with_state(O0, at::kByte));
  torch::manual_seed(4);
  const at::Tensor gradient = torch::rand({64 * 256}) + 0.5;
  for (int step = 0; step < 201; ++step) {
    optimizer.zero_grad();
    {
      scale_loss scaled((w * (step == 0 ? gradient : torch::zeros_like(gradient))).sum(), optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
  const auto& s = static_cast<const torch::optim::AdamParamState&>(*optimizer.state().at(w.unsafeGetTensorImpl()));
  const at::Tensor v = detail::unpack_state(s.exp_avg_sq(), w.sizes(), true).to(at::kDouble);
  const at::Tensor exact = 0.001 * std::pow(0.999, 200) * gradient.to(at::kDouble).square();
  EXPECT_NEAR((v.sum() / exact.sum()).item<double>(), 1.0, 0.01);  // 0.999^200 = 0.82 of the first
}

// A step skipped for an overflow leaves the packed state the same bytes.
TEST_F(AmpTest, ASkippedStepLeavesEightBitStateTheSameBytes) {
  torch::manual_seed(0);
  Student model;
  amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));
  Handle handle;
  handle.initialize(model, optimizer, with_state(O2, at::kByte));
  for (int step = 0; step < 2; ++step) {
    const auto [x, y] = student_batch(step);
    std::vector<at::Tensor> before = clones(state_of(optimizer, model->parameters()));
    optimizer.zero_grad();
    const at::Tensor logits = model->forward(x);
    {
      scale_loss scaled(torch::cross_entropy_loss(step == 1 ? InfInBackward::apply(logits) : logits, y), optimizer);
      scaled.backward();
    }
    optimizer.step();
    if (step == 0) continue;
    EXPECT_TRUE(last_step_skipped(optimizer));
    const std::vector<at::Tensor> after = state_of(optimizer, model->parameters());
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(BitEqual(after[i], before[i])) << i;
  }
}

// A tensor larger than a chunk of the widened step (2^20 values) is stepped
// in slices of it: from a fresh state the first step's weights are ATen's
// fused AdamW on the whole tensor bit for bit (float32 state: no slices),
// whose moments the packed ones hold within a code step; and the step holds
// a transient of a few slices, not float32 copies of the whole tensor
// (unpacked moments, the noise: 60 MiB here).
TEST_F(AmpTest, ATensorLargerThanAChunkStepsInSlicesAsAWholeTensorDoes) {
  amp::track_allocations();
  const int64_t n = 3 * (int64_t{1} << 20) + 1000;
  torch::manual_seed(8);
  const at::Tensor init = torch::randn({n}), gradient = torch::randn({n});
  std::vector<at::Tensor> weights, exp_avgs;
  for (const auto dtype : {std::optional<at::ScalarType>(), std::optional<at::ScalarType>(at::kByte)}) {
    Vector holder(init.clone());
    const at::Tensor& w = holder->w;
    amp::optim::FusedAdamW optimizer({w}, torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    Handle handle;
    handle.initialize(holder, optimizer, with_state(O0, dtype));
    optimizer.zero_grad();
    {
      scale_loss scaled((w * gradient).sum(), optimizer);
      scaled.backward();
    }
    reset_peak_allocated();
    optimizer.step();
    const AllocatedBytes bytes = allocated_bytes();
    if (dtype) {
      std::printf("8-bit AdamW step of %lld values: %.1f MiB above what it leaves\n", static_cast<long long>(n),
                  (bytes.peak - bytes.current) / 1048576.0);
      EXPECT_LT(bytes.peak - bytes.current, 24 << 20);
    }
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*optimizer.state().at(w.unsafeGetTensorImpl()));
    weights.push_back(w.detach().clone());
    exp_avgs.push_back(detail::state_values(s.exp_avg(), w, false).clone());
  }
  EXPECT_TRUE(BitEqual(weights[1], weights[0]));
  // Within a code step where the codes reach (2^-14 of a block's maximum, about 0.3 here).
  const at::Tensor reached = exp_avgs[0].abs() > 1e-3;
  EXPECT_LE(((exp_avgs[1] - exp_avgs[0]).abs() / exp_avgs[0].abs()).masked_select(reached).max().item<double>(),
            std::exp2(0.125) - 1 + 1e-5);
}

// A gradient whose square overflows float32 (1e30, finite in float32) under
// a static scale, which never skips: float32 state's second moment is inf
// there, and 8-bit state's is not finite either - its block is NaN, where
// it was coded as a finite value. The next step is not finite in both.
TEST_F(AmpTest, AnOverflowingMomentIsNeverCodedAsFinite) {
  for (const auto dtype : {std::optional<at::ScalarType>(), std::optional<at::ScalarType>(at::kByte)}) {
    SCOPED_TRACE(dtype ? "8-bit state" : "float32 state");
    torch::manual_seed(5);
    Vector holder(torch::randn({4096}));
    const at::Tensor& w = holder->w;
    amp::optim::FusedAdam optimizer({w}, torch::optim::AdamOptions(1e-3));
    Handle handle;
    handle.initialize(holder, optimizer, with_state(O0, dtype));
    at::Tensor gradient = torch::randn({4096}) * 1e-3;
    gradient[100] = 1e30f;
    for (int step = 0; step < 2; ++step) {
      optimizer.zero_grad();
      {
        scale_loss scaled((w * gradient).sum(), optimizer);
        scaled.backward();
      }
      optimizer.step();
      EXPECT_FALSE(last_step_skipped(optimizer)) << "a static scale never skips";
      const auto& s = static_cast<const torch::optim::AdamParamState&>(*optimizer.state().at(w.unsafeGetTensorImpl()));
      const at::Tensor v = detail::state_values(s.exp_avg_sq(), w, /*non_negative=*/true);
      EXPECT_FALSE(std::isfinite(v[100].item<float>())) << "step " << step;
      EXPECT_TRUE(v.narrow(0, 256, 4096 - 256).isfinite().all().item<bool>()) << "step " << step;
    }
  }
}

// amp's checkpoints carry the packed state and the rounding streams: a
// resumed run is the uninterrupted one bit for bit, at O2 and O6.
TEST_F(AmpTest, EightBitStateResumesBitForBit) {
  for (const OptLevel level : {O2, O6}) {
    SCOPED_TRACE(to_string(level));
    const TrainedRun whole = train(with_state(level, at::kByte), 6), resumed = train(with_state(level, at::kByte), 6, Kind::kAdamW, 3);
    for (size_t i = 0; i < whole.params.size(); ++i) EXPECT_TRUE(BitEqual(whole.params[i], resumed.params[i])) << i;
    ASSERT_EQ(whole.state.size(), resumed.state.size());
    for (size_t i = 0; i < whole.state.size(); ++i) EXPECT_TRUE(BitEqual(whole.state[i], resumed.state[i])) << i;
  }
}

// A checkpoint's state loads into a run keeping another dtype: unpacked
// exactly into float32, or packed (to nearest) from it; training goes on.
TEST_F(AmpTest, EightBitStateLoadsIntoEitherStateDtype) {
  const Options eight = with_state(O2, at::kByte), float32 = with_state(O2, std::nullopt);
  for (const bool into_eight : {false, true}) {
    SCOPED_TRACE(into_eight ? "float32 into 8-bit" : "8-bit into float32");
    const std::string path = temp_path("eight_bit_convert.pt");
    const TrainedRun saved = train(into_eight ? float32 : eight, 3, Kind::kAdamW, -1, std::nullopt, path);
    torch::manual_seed(1);
    Student model;
    amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
    Handle handle;
    handle.initialize(model, optimizer, into_eight ? eight : float32);
    load_checkpoint(path, {model}, {optimizer});
    std::remove(path.c_str());
    const std::vector<at::Tensor> loaded = state_of(optimizer, model->parameters());
    ASSERT_EQ(loaded.size(), saved.state.size());
    for (size_t i = 0; i < loaded.size(); ++i) {
      const at::Tensor& p = saved.params[i / 3];
      const bool non_negative = i % 3 == 2;
      const at::Tensor expected = loaded[i].dim() == 0 || p.numel() < 4096 ? saved.state[i]  // float32 either way
                                  : into_eight ? detail::pack_state(saved.state[i], non_negative, nullptr)
                                               : detail::unpack_state(saved.state[i], p.sizes(), non_negative);
      EXPECT_TRUE(BitEqual(loaded[i], expected)) << i;
    }
  }
  const TrainedRun unpacked = train(eight, 5, Kind::kAdamW, 3, float32), packed = train(float32, 5, Kind::kAdamW, 3, eight);
  EXPECT_EQ(unpacked.state[1].scalar_type(), at::kFloat);
  EXPECT_TRUE(detail::is_packed_state(packed.state[1]));
}

// The program's own torch::save / torch::load carry the packed state as
// LibTorch's Adam state holds it; float32 state the program loads into an
// 8-bit run is packed as it is first stepped.
TEST_F(AmpTest, EightBitStateTravelsThroughTheProgramsOwnSaveAndLoad) {
  auto one_step = [](Student& model, torch::optim::Optimizer& optimizer, int step) {
    const auto [x, y] = student_batch(step);
    optimizer.zero_grad();
    const at::Tensor loss = torch::cross_entropy_loss(model->forward(x), y);
    if (is_initialized()) {
      scale_loss scaled(loss, optimizer);
      scaled.backward();
    } else {
      loss.backward();
    }
    optimizer.step();
  };
  std::stringstream float_bytes;
  {
    torch::manual_seed(0);
    Student plain;  // a run without amp, saved by the program
    amp::optim::FusedAdamW optimizer(plain->parameters(), torch::optim::AdamWOptions(3e-3));
    one_step(plain, optimizer, 0);
    torch::save(optimizer, float_bytes);
  }
  torch::manual_seed(0);
  Student model;
  amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));
  Handle handle;
  handle.initialize(model, optimizer, with_state(O2, at::kByte));
  one_step(model, optimizer, 0);
  std::stringstream bytes;
  torch::save(optimizer, bytes);
  amp::optim::FusedAdamW reloaded(model->parameters(), torch::optim::AdamWOptions(3e-3));
  torch::load(reloaded, bytes);
  const std::vector<at::Tensor> a = state_of(optimizer, model->parameters()), b = state_of(reloaded, model->parameters());
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(BitEqual(a[i], b[i])) << i;

  torch::load(optimizer, float_bytes);
  EXPECT_EQ(state_of(optimizer, model->parameters())[1].scalar_type(), at::kFloat);
  one_step(model, optimizer, 1);
  EXPECT_TRUE(detail::is_packed_state(state_of(optimizer, model->parameters())[1]));
  EXPECT_EQ(static_cast<const torch::optim::AdamWParamState&>(
                *optimizer.state().at(model->fc1->weight.unsafeGetTensorImpl())).step(), 2);
}

// Adam's two moments: 257 bytes per 256 values each, 2.01 bytes a
// parameter (float32: 8); parameters under 4096 elements keep float32
// state, where a block's scale and padding would cost more than they save.
TEST_F(AmpTest, EightBitAdamStateTakesTwoBytesAParameter) {
  const TrainedRun run = train(with_state(O5, at::kByte), 1);
  int64_t expected = 0, parameters = 0;
  for (size_t i = 0; i < run.params.size(); ++i) {
    const at::Tensor& p = run.params[i];
    const bool packed = p.numel() >= 4096;
    expected += packed ? 2 * detail::packed_blocks(p.numel()) * detail::kPackedRow : 8 * p.numel();
    parameters += p.numel();
    EXPECT_EQ(detail::is_packed_state(run.state[3 * i + 1]), packed) << i;
    EXPECT_EQ(run.state[3 * i + 2].scalar_type(), packed ? at::kByte : at::kFloat) << i;
  }
  EXPECT_EQ(run.bytes.optimizer_state, expected);
  EXPECT_EQ(run.bytes.parameters, parameters);
  const int64_t fc1 = run.params[0].numel();  // 4800: 19 blocks
  EXPECT_NEAR(2.0 * 19 * detail::kPackedRow / fc1, 2.03, 0.01);
  EXPECT_EQ(train(with_state(O5, std::nullopt), 1).bytes.optimizer_state, 8 * parameters);
}

// On a GPU: packing to nearest gives the CPU's bytes, and a fused step packs
// its state on the device.
TEST_F(AmpTest, OnCudaEightBitStateIsTheCpusAndStaysOnTheDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  for (const bool non_negative : {false, true}) {
    const at::Tensor values = wide_values(non_negative, 3);
    const at::Tensor on_cpu = detail::pack_state(values, non_negative, nullptr);
    const at::Tensor on_cuda = detail::pack_state(values.cuda(), non_negative, nullptr);
    EXPECT_TRUE(BitEqual(on_cuda, on_cpu)) << non_negative;
    EXPECT_TRUE(BitEqual(detail::unpack_state(on_cuda, {1000}, non_negative), detail::unpack_state(on_cpu, {1000}, non_negative)));
  }
  for (const OptLevel level : {O2, O6}) {
    torch::manual_seed(0);
    Student model;
    model->to(torch::kCUDA);
    amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));
    Handle handle;
    handle.initialize(model, optimizer, with_state(level, at::kByte));
    std::vector<double> losses;
    for (int step = 0; step < 20; ++step) {
      const auto [x, y] = student_batch(step);
      optimizer.zero_grad();
      const at::Tensor loss = torch::cross_entropy_loss(model->forward(x.cuda()).to(at::kFloat), y.cuda());
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      losses.push_back(loss.item<double>());
    }
    const at::Tensor state = state_of(optimizer, model->parameters())[1];
    EXPECT_TRUE(detail::is_packed_state(state) && state.is_cuda()) << to_string(level);
    EXPECT_LT(losses.back(), 0.8 * losses.front()) << to_string(level);
  }
}

// ---- Errors ----------------------------------------------------------------

TEST_F(AmpTest, EightBitStateRefusesWhatCannotStepIt) {
  torch::manual_seed(0);
  Student model;
  torch::optim::AdamW own(model->parameters(), torch::optim::AdamWOptions(1e-3));
  EXPECT_AMP_ERROR(initialize(model, own, with_state(O2, at::kByte)), "Use amp::optim::FusedAdamW, FusedAdam or FusedSGD");
  EXPECT_FALSE(is_initialized());
  EXPECT_EQ(model->fc1->weight.scalar_type(), at::kFloat);  // nothing changed
  amp::optim::FusedAdamW fused(model->parameters(), torch::optim::AdamWOptions(1e-3));
  EXPECT_AMP_ERROR(initialize(model, fused, with_state(O3, at::kByte)), "Use O2, O5 or O6");
  EXPECT_AMP_ERROR(initialize(model, fused, with_state(O6, at::kHalf)), "or uint8 (8-bit state, torch::kUInt8)");
  EXPECT_AMP_ERROR(initialize(model, fused, with_state(O2, at::kFloat)), "applies with stochastic_rounding (O6)");
  EXPECT_FALSE(is_initialized());
  // A gradient the kernels cannot take (sparse), where LibTorch's step
  // cannot read 8-bit state either.
  torch::nn::Embedding embedding(torch::nn::EmbeddingOptions(300, 8).sparse(true));
  amp::optim::FusedAdam sparse_adam(embedding->parameters(), torch::optim::AdamOptions(1e-3));
  Handle handle;
  handle.initialize(embedding, sparse_adam, with_state(O0, at::kByte));
  sparse_adam.zero_grad();
  {
    scale_loss scaled(embedding->forward(torch::arange(4)).sum(), sparse_adam);
    scaled.backward();
  }
  EXPECT_AMP_ERROR(sparse_adam.step(), "only amp's fused kernels step");
  EXPECT_TRUE(sparse_adam.state().empty());
}

}  // namespace
}  // namespace amp::testing
