// SPDX-License-Identifier: BSD-3-Clause
// The fp8 property: per-operand scaling as the recipe states it (exact
// scale sequences), saturation, a linear layer's forward and gradients
// against float64, and training a plain model with no edit beside O5.
#include "test_util.h"

#include "fp8/fp8_linear.h"
#include "fp8/fp8_quantize.h"
#include "fp8/fp8_scaler.h"
#include "session/context.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>

namespace amp::testing {
namespace {

using Fp8Scaling = Options::Fp8Scaling;
constexpr double kE5m2Max = 57344.0;

// A tensor whose largest magnitude is `amax`.
at::Tensor with_amax(double amax) { return torch::tensor({amax / 4, -amax, amax / 2}, torch::kFloat); }

float scale_of(const detail::Fp8Scaler& s) { return s.scale().item<float>(); }

// The recipe's scale for the window of amaxes, computed on the host.
float expected_scale(const std::deque<double>& window, Fp8Scaling::Amax compute, int margin, double max) {
  const double amax = compute == Fp8Scaling::Amax::kMax ? *std::max_element(window.begin(), window.end()) : window.back();
  return static_cast<float>((static_cast<float>(max) / static_cast<float>(amax)) / std::ldexp(1.0, margin));
}

struct RecipeCase {
  Fp8Scaling::Amax compute;
  int margin;
  int64_t history;
};

class DelayedScalingTest : public ::testing::TestWithParam<RecipeCase> {};

TEST_P(DelayedScalingTest, AKnownAmaxSequenceGivesTheRecipesScaleSequence) {
  const RecipeCase c = GetParam();
  Fp8Scaling recipe;
  recipe.amax_compute = c.compute;
  recipe.margin = c.margin;
  recipe.amax_history_len = c.history;
  detail::Fp8Scaler scaler(recipe, at::kFloat8_e4m3fn);
  const std::vector<double> amaxes = {2, 4, 1, 1, 1, 0.5, 8, 3};
  std::deque<double> window;
  float used = static_cast<float>((kE4m3Max / 2.0) / std::ldexp(1.0, c.margin));  // before any update: current
  for (size_t i = 0; i < amaxes.size(); ++i) {
    const auto [x8, inverse] = scaler.quantize(with_amax(amaxes[i]));
    EXPECT_FLOAT_EQ(inverse.item<float>(), 1.0f / used) << "iteration " << i;
    // Saturated, never NaN: an amax above the delayed scale's range clamps.
    const at::Tensor expected = (with_amax(amaxes[i]) * used).clamp(-kE4m3Max, kE4m3Max).to(at::kFloat8_e4m3fn);
    EXPECT_TRUE(BitEqual(x8, expected)) << "iteration " << i;
    scaler.update();
    window.push_back(amaxes[i]);
    if (static_cast<int64_t>(window.size()) > c.history) window.pop_front();
    used = expected_scale(window, c.compute, c.margin, kE4m3Max);
    EXPECT_FLOAT_EQ(scale_of(scaler), used) << "after iteration " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, DelayedScalingTest,
                         ::testing::Values(RecipeCase{Fp8Scaling::Amax::kMax, 0, 3},
                                           RecipeCase{Fp8Scaling::Amax::kMax, 1, 1},
                                           RecipeCase{Fp8Scaling::Amax::kMostRecent, 0, 4},
                                           RecipeCase{Fp8Scaling::Amax::kMax, 2, 16}));

TEST(Fp8ScalerTest, CallsOfOneIterationShareTheHistorysFirstSlot) {
  detail::Fp8Scaler scaler(Fp8Scaling{}, at::kFloat8_e5m2);
  scaler.quantize(with_amax(3));
  scaler.quantize(with_amax(5));  // a second micro-batch, or a recomputed block
  scaler.quantize(with_amax(1));
  EXPECT_FLOAT_EQ(scaler.amax_history()[0].item<float>(), 5.0f);
  scaler.update();
  EXPECT_FLOAT_EQ(scale_of(scaler), static_cast<float>(kE5m2Max) / 5.0f);
  EXPECT_FLOAT_EQ(scaler.amax_history()[0].item<float>(), 0.0f);
}

// A CUDA graph captured over a step replays its kernels on the memory they
// saw at capture: the scaling state must stay in place through updates.
TEST(Fp8ScalerTest, UpdatesKeepTheStateInItsMemory) {
  detail::Fp8Scaler scaler(Fp8Scaling{}, at::kFloat8_e4m3fn);
  scaler.quantize(with_amax(3));
  const void* scale = scaler.scale().const_data_ptr();
  const void* history = scaler.amax_history().const_data_ptr();
  for (int i = 0; i < 3; ++i) {
    scaler.update();
    scaler.quantize(with_amax(2 + i));
  }
  EXPECT_EQ(scaler.scale().const_data_ptr(), scale);
  EXPECT_EQ(scaler.amax_history().const_data_ptr(), history);
  EXPECT_FLOAT_EQ(scaler.amax_history()[0].item<float>(), 4.0f);  // this iteration's
  EXPECT_FLOAT_EQ(scaler.amax_history()[scaler.amax_history().size(0) - 1].item<float>(), 3.0f);  // rolled to the end
}

TEST(Fp8ScalerTest, ZeroOrNonFiniteAmaxKeepsTheScale) {
  detail::Fp8Scaler scaler(Fp8Scaling{}, at::kFloat8_e4m3fn);
  scaler.quantize(with_amax(7));
  scaler.update();
  const float before = scale_of(scaler);
  scaler.quantize(torch::zeros({4}));
  scaler.update();
  EXPECT_FLOAT_EQ(scale_of(scaler), before);  // the history still holds 7
  Fp8Scaling latest;
  latest.amax_compute = Fp8Scaling::Amax::kMostRecent;
  detail::Fp8Scaler recent(latest, at::kFloat8_e4m3fn);
  recent.quantize(with_amax(7));
  recent.update();
  const auto [x8, inverse] = recent.quantize(torch::tensor({1.0f, std::numeric_limits<float>::infinity()}));
  EXPECT_FLOAT_EQ(x8.to(at::kFloat)[1].item<float>(), static_cast<float>(kE4m3Max));  // saturated,
  EXPECT_TRUE(std::isnan(inverse.item<float>()));  // but the product will not be finite
  recent.update();
  EXPECT_FLOAT_EQ(scale_of(recent), static_cast<float>(kE4m3Max) / 7.0f);
}

TEST(Fp8ScalerTest, CurrentScalingScalesEachCallByItsOwnAmax) {
  Fp8Scaling current;
  current.recipe = Fp8Scaling::Recipe::kCurrent;
  detail::Fp8Scaler scaler(current, at::kFloat8_e4m3fn);
  for (double amax : {2.0, 100.0, 0.25}) {
    const auto [x8, inverse] = scaler.quantize(with_amax(amax));
    EXPECT_FLOAT_EQ(inverse.item<float>(), 1.0f / (static_cast<float>(kE4m3Max) / static_cast<float>(amax)));
    EXPECT_FLOAT_EQ(x8.to(at::kFloat).abs().max().item<float>(), static_cast<float>(kE4m3Max));
  }
}

// Calls fn(recipe, format, dtype, what) for each case the fused CUDA kernels
// take: both recipes (with an amax history of `history`), both float8
// formats, float32, bfloat16 and float16 inputs; `what` names the case.
template <class Fn>
void for_each_kernel_case(int64_t history, Fn fn) {
  for (auto kind : {Fp8Scaling::Recipe::kDelayed, Fp8Scaling::Recipe::kCurrent}) {
    for (at::ScalarType format : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        Fp8Scaling recipe;
        recipe.recipe = kind;
        recipe.amax_history_len = history;
        fn(recipe, format, dtype,
           std::string(kind == Fp8Scaling::Recipe::kDelayed ? "delayed " : "current ") + c10::toString(format) +
               " from " + c10::toString(dtype));
      }
    }
  }
}

// A 1100 x 1000 matrix - several passes of the kernels' grid (an H200's 132
// SMs x 8 blocks x 256 threads cover 270k values a pass) - of values over a
// wide range, every 997th one subnormal in `dtype` (either sign), and with
// `non_finite` a NaN, an inf and a -inf far apart.
at::Tensor hard_input(at::ScalarType dtype, c10::Device device, bool non_finite) {
  at::Tensor x = torch::randn({1100, 1000}) * torch::exp(torch::randn({1100, 1000}) * 1.5);  // |x| < 65504: float16 holds them
  const double subnormal = dtype == at::kHalf ? 3e-6 : 1e-40;  // below the dtype's smallest normal
  x.view(-1).slice(0, 7, x.numel(), 997).fill_(subnormal);
  x.view(-1).slice(0, 500, x.numel(), 1994).fill_(-subnormal);
  if (non_finite) {
    x.view(-1)[12345] = std::numeric_limits<float>::quiet_NaN();
    x.view(-1)[600001] = std::numeric_limits<float>::infinity();
    x.view(-1)[1099999] = -std::numeric_limits<float>::infinity();
  }
  return x.to(dtype).to(device);
}

// `x` quantized at `scale`, value by value: the product in float64 (exact
// for two float32 values), saturated, rounded to float32 and converted to
// `format` by c10's scalar conversion.
at::Tensor quantized_by_hand(const at::Tensor& x, float scale, at::ScalarType format, double max) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = torch::empty(x.sizes(), torch::TensorOptions(format));
  const float* in = xf.data_ptr<float>();
  for (int64_t i = 0; i < xf.numel(); ++i) {
    const double y = in[i] * static_cast<double>(scale);
    const float v = static_cast<float>(std::isnan(y) ? y : std::clamp(y, -max, max));
    if (format == at::kFloat8_e4m3fn) {
      out.data_ptr<c10::Float8_e4m3fn>()[i] = c10::Float8_e4m3fn(v);
    } else {
      out.data_ptr<c10::Float8_e5m2>()[i] = c10::Float8_e5m2(v);
    }
  }
  return out;
}

// The ATen path (every build's on the CPU; the reference the CUDA kernels
// are held to) at the CUDA kernels' test sizes, with subnormal, NaN and inf
// inputs: every value as float64 arithmetic and c10's scalar conversion
// give it (NaN stays NaN, an inf saturates), the scale the recipe's (delayed:
// the first iteration's amax throughout, as the NaN iteration adds nothing
// to the history; current: each finite iteration's own, the stored 1
// where the amax is not finite) and the inverse scale NaN where the input is
// not finite.
TEST(Fp8ScalerTest, TheAtenPathQuantizesLargeSubnormalAndNonFiniteInputsAsFloat64Does) {
  for_each_kernel_case(2, [&](const Fp8Scaling& recipe, at::ScalarType format, at::ScalarType dtype,
                              const std::string& what) {
    const double max = format == at::kFloat8_e4m3fn ? 448.0 : kE5m2Max;
    const bool delayed = recipe.recipe == Fp8Scaling::Recipe::kDelayed;
    detail::Fp8Scaler scaler(recipe, format);
    torch::manual_seed(0);
    float first_scale = 0;
    for (int iteration = 0; iteration < 3; ++iteration) {
      const bool non_finite = iteration == 1;
      const at::Tensor x = hard_input(dtype, torch::kCPU, non_finite);
      const float amax = x.to(at::kFloat).abs().max().item<float>();
      const float fresh = (1.0f / amax) * static_cast<float>(max);
      if (iteration == 0) first_scale = fresh;
      const float scale = delayed ? first_scale : (non_finite ? 1.0f : fresh);
      const auto [x8, inverse] = scaler.quantize(x, /*tally=*/false);
      const std::string where = what + ", iteration " + std::to_string(iteration);
      EXPECT_TRUE(BitEqual(x8, quantized_by_hand(x, scale, format, max))) << where;
      if (non_finite) {
        EXPECT_TRUE(std::isnan(inverse.item<float>())) << where;
      } else {
        EXPECT_EQ(inverse.item<float>(), 1.0f / scale) << where;
      }
      scaler.update();
      EXPECT_TRUE(scaler.amax_history().isfinite().all().item<bool>()) << where << ": an inf or NaN stays out";
    }
  });
}

// The fused CUDA kernels (fp8_quantize.cu) against the ATen path they
// replace, side by side: every output, the amax history and the scale bit
// for bit over iterations, for both recipes, both formats, float32,
// bfloat16 and float16 inputs, zeros, a saturating outlier, inputs of
// several grid passes with subnormal values and, once, NaN and infs, and an
// inf (the inverse scale NaN on both).
TEST(Fp8ScalerTest, OnCudaTheFusedKernelsAreTheAtenPathBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  const auto cuda = torch::TensorOptions(torch::kCUDA);
  for_each_kernel_case(4, [&](const Fp8Scaling& recipe, at::ScalarType format, at::ScalarType dtype,
                              const std::string& what) {
    detail::Fp8Scaler fused(recipe, format), reference(recipe, format);
    torch::manual_seed(0);
    for (int iteration = 0; iteration < 5; ++iteration) {
      std::vector<at::Tensor> inputs = {torch::randn({1000, 48}, cuda) * (iteration + 1),
                                        torch::randn({37}, cuda) * 1e-3};
      if (iteration == 2) inputs.push_back(torch::zeros({64}, cuda));
      if (iteration == 3) inputs.back()[5] = 3e4;  // saturates e4m3 at the delayed scale
      // Several grid passes, subnormal values, and at iteration 4 NaN and infs.
      inputs.push_back(hard_input(dtype, torch::kCUDA, iteration == 4));
      for (const at::Tensor& input : inputs) {
        const at::Tensor x = input.to(dtype);
        const auto [x8, inverse] = fused.quantize(x, /*tally=*/false);
        const auto [r8, r_inverse] = reference.quantize_reference(x, /*tally=*/false);
        EXPECT_TRUE(BitEqual(x8, r8)) << what << ", iteration " << iteration;
        EXPECT_TRUE(BitEqual(inverse, r_inverse)) << what << ", iteration " << iteration;
      }
      fused.update();
      reference.update();
      EXPECT_TRUE(BitEqual(fused.scale(), reference.scale())) << what << ", iteration " << iteration;
      EXPECT_TRUE(BitEqual(fused.amax_history(), reference.amax_history())) << what << ", iteration " << iteration;
    }
    at::Tensor bad = torch::randn({256}, cuda).to(dtype);
    bad[7] = std::numeric_limits<float>::infinity();
    const auto [b8, b_inverse] = fused.quantize(bad, false);
    const auto [r8, r_inverse] = reference.quantize_reference(bad, false);
    EXPECT_TRUE(std::isnan(b_inverse.item<float>()) && std::isnan(r_inverse.item<float>())) << what;
    EXPECT_TRUE(BitEqual(b8, r8)) << what << ": the finite values and the saturated inf";
    fused.update();
    reference.update();
    EXPECT_TRUE(BitEqual(fused.amax_history(), reference.amax_history())) << what << ": an inf stays out";
  });
}

// Which code quantizes float8 operands: the CPU says it emulates; a CUDA
// device takes amp's kernels wherever the build has them (every CUDA build
// with a float8 architecture: AMP_TEST_FP8_KERNELS).
TEST(Fp8PathTest, TheCpuSaysFloat8IsEmulated) {
  EXPECT_THAT(fp8_quantization_path(torch::kCPU), ::testing::HasSubstr("emulated on the CPU"));
}

TEST(Fp8PathTest, OnCudaTheBuildsKernelsQuantize) {
  if (const std::string why = no_cuda_float8(); !why.empty()) GTEST_SKIP() << why;
#ifdef AMP_TEST_FP8_KERNELS
  EXPECT_THAT(fp8_quantization_path(torch::kCUDA), ::testing::HasSubstr("amp's fused CUDA kernels"));
  EXPECT_TRUE(detail::fused_fp8_quantize_applies(torch::ones({4}, torch::kCUDA)));
#else
  EXPECT_THAT(fp8_quantization_path(torch::kCUDA), ::testing::HasSubstr("has no float8 kernels"));
#endif
}

// A matrix's quantization with its transpose (what the backward GEMMs take):
// the values and inverse scale quantize() gives, and their transpose.
TEST(Fp8ScalerTest, QuantizeTransposedIsQuantizeAndItsTranspose) {
  torch::manual_seed(1);
  Fp8Scaling recipe;
  detail::Fp8Scaler with(recipe, at::kFloat8_e4m3fn), without(recipe, at::kFloat8_e4m3fn);
  for (int iteration = 0; iteration < 3; ++iteration) {
    const at::Tensor x = (torch::randn({37, 20}) * (iteration + 1)).to(at::kBFloat16);
    const auto [x8, inverse, x8_t] = with.quantize_transposed(x);
    const auto [r8, r_inverse] = without.quantize(x);
    EXPECT_TRUE(BitEqual(x8, r8));
    EXPECT_TRUE(BitEqual(inverse, r_inverse));
    ASSERT_EQ(x8_t.sizes(), (std::vector<int64_t>{20, 37}));
    EXPECT_TRUE(x8_t.is_contiguous());
    EXPECT_TRUE(BitEqual(x8_t, r8.t().contiguous()));
    with.update();
    without.update();
    EXPECT_TRUE(BitEqual(with.amax_history(), without.amax_history()));
  }
  const at::Tensor m = torch::randn({5, 3}).to(at::kFloat8_e5m2);
  EXPECT_TRUE(BitEqual(detail::fp8_transposed(m), m.t().contiguous()));
}

// The fused cast-transpose and the float8 transpose on CUDA against the
// ATen path, bit for bit: both recipes and formats, three input dtypes,
// shapes that are not multiples of the kernels' 32 x 32 tiles.
TEST(Fp8ScalerTest, OnCudaTheCastTransposeIsTheAtenPathBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  const auto cuda = torch::TensorOptions(torch::kCUDA);
  const std::vector<std::vector<int64_t>> shapes = {{1000, 48}, {33, 70}, {1, 17}, {64, 1}, {300, 257}, {1100, 1000}};
  for_each_kernel_case(3, [&](const Fp8Scaling& recipe, at::ScalarType format, at::ScalarType dtype,
                              const std::string& what) {
    detail::Fp8Scaler fused(recipe, format), reference(recipe, format);
    torch::manual_seed(0);
    for (int iteration = 0; iteration < 3; ++iteration) {
      for (const auto& shape : shapes) {
        // The largest: several grid passes, subnormal values, NaN and infs at iteration 2.
        const at::Tensor x = shape[0] == 1100 ? hard_input(dtype, torch::kCUDA, iteration == 2)
                                              : (torch::randn(shape, cuda) * (iteration + 1)).to(dtype);
        const auto [x8, inverse, x8_t] = fused.quantize_transposed(x, /*tally=*/false);
        const auto [r8, r_inverse] = reference.quantize_reference(x, /*tally=*/false);
        const std::string where = what + ", " + std::to_string(shape[0]) + " x " + std::to_string(shape[1]);
        EXPECT_TRUE(BitEqual(x8, r8)) << where;
        EXPECT_TRUE(BitEqual(inverse, r_inverse)) << where;
        EXPECT_TRUE(x8_t.is_contiguous() && BitEqual(x8_t, r8.t().contiguous())) << where;
        EXPECT_TRUE(BitEqual(detail::fp8_transposed(r8), r8.t().contiguous())) << where;
      }
      fused.update();
      reference.update();
      EXPECT_TRUE(BitEqual(fused.scale(), reference.scale())) << what;
      EXPECT_TRUE(BitEqual(fused.amax_history(), reference.amax_history())) << what;
    }
  });
  // A float8 matrix the kernel does not take (a transposed view): ATen's copy.
  const at::Tensor m = torch::randn({40, 24}, cuda).to(at::kFloat8_e4m3fn).t();
  EXPECT_TRUE(BitEqual(detail::fp8_transposed(m), m.t().contiguous()));
}

// ---- One linear layer against float64 ---------------------------------------

// `t` rounded as the GEMM sees it: scaled, saturated, in `format`, unscaled.
at::Tensor as_fp8(const at::Tensor& t, at::ScalarType format, double max) {
  const double scale = max / t.abs().max().item<double>();
  return (t.to(at::kDouble) * scale).clamp(-max, max).to(at::kFloat).to(format).to(at::kDouble) / scale;
}

struct FormatCase {
  Fp8Scaling::Format format;
  at::ScalarType backward;
  double backward_max;
};

class Fp8LinearTest : public ::testing::TestWithParam<FormatCase> {};

TEST_P(Fp8LinearTest, ForwardAndBothGradientsMatchFloat64OfTheRoundedOperands) {
  torch::manual_seed(3);
  const FormatCase c = GetParam();
  Fp8Scaling recipe;
  recipe.recipe = Fp8Scaling::Recipe::kCurrent;
  recipe.format = c.format;
  auto site = std::make_shared<detail::Fp8Site>(recipe, at::kFloat8_e4m3fn, c.backward);
  const at::Tensor x = torch::randn({2, 8, 32}).to(at::kBFloat16).requires_grad_();
  const at::Tensor w = (torch::randn({24, 32}) * 0.2).to(at::kBFloat16).requires_grad_();
  const at::Tensor b = torch::randn({24}).to(at::kBFloat16).requires_grad_();
  const at::Tensor y = detail::fp8_linear(x, w, b, site);
  ASSERT_EQ(y.scalar_type(), at::kBFloat16);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 8, 24}));
  const at::Tensor g = torch::randn({2, 8, 24}).to(at::kBFloat16);
  y.backward(g);

  const at::Tensor x8 = as_fp8(x.detach().reshape({16, 32}), at::kFloat8_e4m3fn, kE4m3Max);
  const at::Tensor w8 = as_fp8(w.detach(), at::kFloat8_e4m3fn, kE4m3Max);
  const at::Tensor g8 = as_fp8(g.reshape({16, 24}), c.backward, c.backward_max);
  const at::Tensor y64 = x8.matmul(w8.t()) + b.detach().to(at::kDouble);
  const at::Tensor dx64 = g8.matmul(w8);
  const at::Tensor dw64 = g8.t().matmul(x8);
  // The GEMMs accumulate in float32 and round once to bfloat16 (2^-8
  // relative); the bias adds one more bfloat16 rounding.
  auto within = [](const at::Tensor& got, const at::Tensor& want, const at::Tensor& magnitude) {
    const at::Tensor err = (got.to(at::kDouble).reshape(want.sizes()) - want).abs();
    return (err <= magnitude * std::ldexp(1.0, -7) + 1e-6).all().item<bool>();
  };
  EXPECT_TRUE(within(y, y64, x8.abs().matmul(w8.abs().t()) + b.detach().abs().to(at::kDouble)));
  EXPECT_TRUE(within(x.grad(), dx64, g8.abs().matmul(w8.abs())));
  EXPECT_TRUE(within(w.grad(), dw64, g8.abs().t().matmul(x8.abs())));
  EXPECT_TRUE(within(b.grad(), g.reshape({16, 24}).to(at::kDouble).sum(0), g.reshape({16, 24}).to(at::kDouble).abs().sum(0)));
  // Against the unrounded operands. float8 moves each operand by at most
  // half a step: 2^-4 (e4m3) or 2^-3 (e5m2) of its value, or, below the
  // smallest normal, half the smallest subnormal step (2^-10 or 2^-17 of
  // the scaled unit: the operand's amax / the format's max).
  const at::Tensor xd = x.detach().reshape({16, 32}).to(at::kDouble), wd = w.detach().to(at::kDouble);
  const at::Tensor gd = g.reshape({16, 24}).to(at::kDouble), bd = b.detach().to(at::kDouble);
  auto half_step = [](const at::Tensor& v, bool e5m2, double max) {
    const double unit = v.abs().max().item<double>() / max;
    return torch::maximum(v.abs() * std::ldexp(1.0, e5m2 ? -3 : -4),
                          torch::full_like(v, unit * std::ldexp(1.0, e5m2 ? -17 : -10)));
  };
  const bool e5m2 = c.backward == at::kFloat8_e5m2;
  const at::Tensor ex = (xd - x8).abs(), ew = (wd - w8).abs(), eg = (gd - g8).abs();
  EXPECT_TRUE((ex <= half_step(xd, false, kE4m3Max)).all().item<bool>());
  EXPECT_TRUE((ew <= half_step(wd, false, kE4m3Max)).all().item<bool>());
  EXPECT_TRUE((eg <= half_step(gd, e5m2, c.backward_max)).all().item<bool>());
  // A product a*b then moves by at most e_a |b8| + |a| e_b, and each result's
  // bfloat16 rounding (and the bias's) adds 2^-7 of its magnitude.
  const double bf16 = std::ldexp(1.0, -7);
  auto moved_by = [](const at::Tensor& ea, const at::Tensor& b8, const at::Tensor& a, const at::Tensor& eb) {
    return ea.matmul(b8.abs()) + a.abs().matmul(eb);
  };
  const at::Tensor y_err = (y.detach().reshape({16, 24}).to(at::kDouble) - (xd.matmul(wd.t()) + bd)).abs();
  EXPECT_TRUE((y_err <= moved_by(ex, w8.t(), xd, ew.t()) + (x8.abs().matmul(w8.abs().t()) + bd.abs()) * bf16)
                  .all().item<bool>());
  const at::Tensor dx_err = (x.grad().reshape({16, 32}).to(at::kDouble) - gd.matmul(wd)).abs();
  EXPECT_TRUE((dx_err <= moved_by(eg, w8, gd, ew) + g8.abs().matmul(w8.abs()) * bf16).all().item<bool>());
  const at::Tensor dw_err = (w.grad().to(at::kDouble) - gd.t().matmul(xd)).abs();
  EXPECT_TRUE((dw_err <= moved_by(eg.t(), x8, gd.t(), ex) + g8.abs().t().matmul(x8.abs()) * bf16).all().item<bool>());
  // And it is float8, not bfloat16: the rounding shows.
  EXPECT_GT(y_err.max().item<double>(), 0.0);
  EXPECT_FALSE(BitEqual(y.detach(), torch::linear(x.detach(), w.detach(), b.detach())));
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8LinearTest,
                         ::testing::Values(FormatCase{Fp8Scaling::Format::kHybrid, at::kFloat8_e5m2, kE5m2Max},
                                           FormatCase{Fp8Scaling::Format::kE4M3, at::kFloat8_e4m3fn, kE4m3Max}));

// ---- The property in training ------------------------------------------------

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(32, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 64))),
        fc3(register_module("fc3", torch::nn::Linear(64, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

class Fp8TrainingTest : public AmpTest {
 protected:
  // Trains a fresh Mlp on a fixed task; returns the mean loss of the last 10 steps.
  double train(Options options, int steps, std::vector<float>* first_scales = nullptr) {
    torch::manual_seed(0);
    Mlp model;
    amp::optim::FusedAdam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));
    initialize(model, optimizer, quiet(options));
    const at::Tensor inputs = torch::randn({512, 32});
    const at::Tensor targets = inputs.narrow(1, 0, 4).argmax(1);
    double tail = 0;
    for (int step = 0; step < steps; ++step) {
      const at::Tensor x = inputs.narrow(0, (step * 64) % 512, 64), y = targets.narrow(0, (step * 64) % 512, 64);
      optimizer.zero_grad();
      const at::Tensor loss = torch::nn::functional::cross_entropy(model->forward(x).to(at::kFloat), y);
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      if (first_scales && step == 0) {
        const auto site = detail::live_context()->fp8()->site_of(model->fc1->weight);
        first_scales->push_back(site ? site->input.scale().item<float>() : 0.0f);
      }
      if (step >= steps - 10) tail += loss.item<double>() / 10;
    }
    sites_ = detail::live_context()->fp8() ? detail::live_context()->fp8()->sites() : 0;
    deinitialize();
    return tail;
  }
  int64_t sites_ = 0;
};

// On a CPU, initialize says once that float8 is emulated (at verbosity 1).
TEST_F(Fp8TrainingTest, InitializeSaysOnceThatTheCpuEmulatesFloat8) {
  for (const bool fp8 : {true, false}) {
    for (const int verbosity : {0, 1}) {
      LogRecorder log;
      Mlp model;
      amp::optim::FusedAdam optimizer(model->parameters());
      Options options = fp8 ? fp8_options() : O5;
      options.verbosity = verbosity;
      initialize(model, optimizer, options);
      deinitialize();
      EXPECT_EQ(log.count(LogEvent::Kind::kNote, "fp8_emulated"), fp8 && verbosity == 1 ? 1 : 0)
          << "fp8 " << fp8 << ", verbosity " << verbosity;
    }
  }
}

TEST_F(Fp8TrainingTest, APlainModelTrainsInFloat8BesideO5WithNoEdit) {
  const double o5 = train(O5, 150);
  const double with_fp8 = train(fp8_options(), 150);
  EXPECT_EQ(sites_, 3);      // every Linear ran in float8
  EXPECT_LT(with_fp8, 0.05);  // it learned (ln 4 = 1.39 at the start; O5 reaches 0.008)
  EXPECT_NEAR(with_fp8, o5, 0.1 * o5 + 0.001);
}

TEST_F(Fp8TrainingTest, EveryLinearLayerRunsInFloat8AndTheGuardUpdatesItsScales) {
  torch::manual_seed(0);
  Mlp model;
  amp::optim::FusedAdam optimizer(model->parameters());
  Options options = fp8_options();
  initialize(model, optimizer, quiet(options));
  EXPECT_NE(describe(properties()).find("fp8                   True"), std::string::npos);
  detail::Fp8Gemms& gemms = *detail::live_context()->fp8();
  const at::Tensor x = torch::randn({64, 32});
  OpStatsRecorder recorder;
  const int64_t syncs_before = host_syncs();
  for (int step = 0; step < 3; ++step) {
    optimizer.zero_grad();
    const at::Tensor out = model->forward(x);
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    {
      scale_loss scaled(out.to(at::kFloat).pow(2).mean(), optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
  EXPECT_EQ(host_syncs(), syncs_before);  // healthy steps: none added
  EXPECT_EQ(gemms.sites(), 3);            // one per layer, the same every iteration
  EXPECT_EQ(float8_calls(recorder), std::make_pair(int64_t{9}, int64_t{0}));  // 3 layers x 3 steps, none fell back
  const auto site = gemms.site_of(model->fc2->weight);
  ASSERT_NE(site, nullptr);
  // Three commits: the history holds three iterations' amaxes (slot 0 is
  // the next one's), and the scales come from them.
  EXPECT_GT(site->grad_output.amax_history().narrow(0, 1, 15).gt(0).sum().item<int64_t>(), 0);
  EXPECT_FLOAT_EQ(site->weight.scale().item<float>(),
                  static_cast<float>(kE4m3Max) / site->weight.amax_history().max().item<float>());
}

TEST_F(Fp8TrainingTest, Fp8OutsideO5OrBadScalingIsRefusedAndNothingChanges) {
  Mlp model;
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  for (OptLevel level : {O1, O2, O4, O6}) {
    Options options = level;
    options.fp8 = true;
    EXPECT_AMP_ERROR(initialize(model, optimizer, quiet(options)), "fp8 runs linear layers' GEMMs in float8 on top of O5");
    EXPECT_FALSE(is_initialized());
  }
  Options no_masters = O5;
  no_masters.fp8 = true;
  no_masters.master_weights = false;
  EXPECT_AMP_ERROR(initialize(model, optimizer, quiet(no_masters)), "on top of O5");
  Options bad = O5;
  bad.fp8 = true;
  bad.fp8_scaling.amax_history_len = 0;
  EXPECT_AMP_ERROR(initialize(model, optimizer, quiet(bad)), "amax_history_len must be at least 1");
  bad.fp8_scaling.amax_history_len = 4;
  bad.fp8_scaling.margin = -1;
  EXPECT_AMP_ERROR(initialize(model, optimizer, quiet(bad)), "margin must be >= 0");
  EXPECT_FALSE(is_initialized());
  EXPECT_EQ(model->fc1->weight.scalar_type(), at::kFloat);
}


// On the GPU machine: the same layer on the device's float8 kernel, against
// the CPU's (which the tests above check against float64), and a training
// step at O5+fp8 with its shapes fallback counted.
TEST_F(Fp8TrainingTest, OnCudaTheFloat8KernelMatchesTheCpusAndTrains) {
  if (const std::string why = no_cuda_float8(); !why.empty()) GTEST_SKIP() << why;
  torch::manual_seed(5);
  Fp8Scaling recipe;
  recipe.recipe = Fp8Scaling::Recipe::kCurrent;
  const at::Tensor x = torch::randn({64, 64}).to(at::kBFloat16), w = (torch::randn({32, 64}) * 0.1).to(at::kBFloat16);
  auto cpu_site = std::make_shared<detail::Fp8Site>(recipe, at::kFloat8_e4m3fn, at::kFloat8_e5m2);
  auto cuda_site = std::make_shared<detail::Fp8Site>(recipe, at::kFloat8_e4m3fn, at::kFloat8_e5m2);
  const at::Tensor on_cpu = detail::fp8_linear(x, w, std::nullopt, cpu_site);
  const at::Tensor on_cuda = detail::fp8_linear(x.cuda(), w.cuda(), std::nullopt, cuda_site).cpu();
  EXPECT_TRUE(AllClose({on_cuda.to(at::kFloat)}, {on_cpu.to(at::kFloat)}, 1e-2, 1e-2));
  Options options = fp8_options();
  const double loss = [&] {
    torch::manual_seed(0);
    Mlp model;
    model->to(torch::kCUDA);
    amp::optim::FusedAdam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));
    initialize(model, optimizer, quiet(options));
    const at::Tensor inputs = torch::randn({64, 32}, torch::kCUDA);
    OpStatsRecorder recorder;
    at::Tensor last;
    for (int step = 0; step < 20; ++step) {
      optimizer.zero_grad();
      last = model->forward(inputs).to(at::kFloat).pow(2).mean();
      {
        scale_loss scaled(last, optimizer);
        scaled.backward();
      }
      optimizer.step();
    }
    EXPECT_EQ(float8_calls(recorder).second, 20);  // fc3's 4 outputs: not a multiple of 16
    EXPECT_EQ(detail::live_context()->fp8()->sites(), 2);
    return last.item<double>();
  }();
  EXPECT_TRUE(std::isfinite(loss));
}


// amp's checkpoints carry the scales and histories: a run resumed from one
// continues bit for bit as the uninterrupted run (without them its first
// step would scale by the current amax instead of the history's).
TEST_F(Fp8TrainingTest, ACheckpointResumesTheScalesBitExactly) {
  const std::string path = ::testing::TempDir() + "/fp8_resume.pt";
  Options options = fp8_options();
  const at::Tensor inputs = torch::randn({64, 32}, torch::TensorOptions().dtype(at::kFloat));
  auto run = [&](Mlp& model, amp::optim::FusedAdam& optimizer, int steps) {
    for (int step = 0; step < steps; ++step) {
      optimizer.zero_grad();
      const at::Tensor loss = model->forward(inputs.narrow(0, step * 8 % 32, 32)).to(at::kFloat).pow(2).mean();
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
    }
  };
  torch::manual_seed(1);
  Mlp model;
  amp::optim::FusedAdam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  initialize(model, optimizer, quiet(options));
  run(model, optimizer, 4);
  save_checkpoint(path, {model}, {optimizer});
  run(model, optimizer, 3);
  const at::Tensor scale = detail::live_context()->fp8()->site_of(model->fc2->weight)->grad_output.scale().clone();
  std::vector<at::Tensor> expected;
  for (const auto& p : master_params(optimizer)) expected.push_back(p.detach().clone());
  deinitialize();

  torch::manual_seed(2);  // other weights: the checkpoint must bring them back
  Mlp resumed;
  amp::optim::FusedAdam resumed_optimizer(resumed->parameters(), torch::optim::AdamOptions(1e-2));
  initialize(resumed, resumed_optimizer, quiet(options));
  load_checkpoint(path, {resumed}, {resumed_optimizer});
  run(resumed, resumed_optimizer, 3);
  EXPECT_TRUE(BitEqual(detail::live_context()->fp8()->site_of(resumed->fc2->weight)->grad_output.scale(), scale));
  const auto got = master_params(resumed_optimizer);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(BitEqual(got[i], expected[i])) << "parameter " << i;
}

TEST_F(Fp8TrainingTest, AStateWithFp8ScalesIsRefusedWithoutFp8OrWithAnotherHistory) {
  Options options = fp8_options();
  Mlp model;
  amp::optim::FusedAdam optimizer(model->parameters());
  initialize(model, optimizer, quiet(options));
  optimizer.zero_grad();
  {
    scale_loss scaled(model->forward(torch::randn({8, 32})).to(at::kFloat).sum(), optimizer);
    scaled.backward();
  }
  torch::serialize::OutputArchive out;
  save_state(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  deinitialize();
  auto load = [&] {
    std::istringstream in(bytes.str());
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    load_state(archive);
  };
  initialize(model, optimizer, quiet(O5));
  EXPECT_AMP_ERROR(load(), "amp runs without it; initialize with fp8 = true");
  deinitialize();
  options.fp8_scaling.amax_history_len = 8;
  initialize(model, optimizer, quiet(options));
  EXPECT_AMP_ERROR(load(), "amax_history_len is 8");
  EXPECT_EQ(detail::live_context()->fp8()->sites(), 0);  // nothing loaded
}


// Gradient accumulation: the micro-batches of one step share the history's
// first slot; only the guard that ends the accumulation rolls it.
TEST_F(Fp8TrainingTest, MicroBatchesShareOneHistorySlotUntilTheLastGuard) {
  Options options = fp8_options();
  torch::manual_seed(0);
  Mlp model;
  amp::optim::FusedAdam optimizer(model->parameters());
  initialize(model, optimizer, quiet(options));
  optimizer.zero_grad();
  const at::Tensor x = torch::randn({3, 16, 32});
  for (int micro = 0; micro < 3; ++micro) {
    const at::Tensor loss = model->forward(x[micro] * (micro + 1)).to(at::kFloat).pow(2).mean();
    scale_loss scaled(loss, optimizer, {/*loss_id=*/0, /*delay_unscale=*/micro < 2});
    scaled.backward();
    const at::Tensor history = detail::live_context()->fp8()->site_of(model->fc1->weight)->input.amax_history();
    if (micro < 2) {
      EXPECT_GT(history[0].item<float>(), 0.0f);
      EXPECT_EQ(history.narrow(0, 1, 15).count_nonzero().item<int64_t>(), 0) << "micro-batch " << micro;
    }
  }
  const at::Tensor history = detail::live_context()->fp8()->site_of(model->fc1->weight)->input.amax_history();
  EXPECT_EQ(history[0].item<float>(), 0.0f);  // rolled once, by the last guard
  EXPECT_EQ(history.count_nonzero().item<int64_t>(), 1);
  // The slot holds the largest of the three micro-batches' amaxes (the third's inputs, in bfloat16).
  EXPECT_FLOAT_EQ(history[15].item<float>(), (x[2] * 3).to(at::kBFloat16).abs().max().to(at::kFloat).item<float>());
}


// keep_fp32 layers compute in float32, so they never reach float8; a
// recomputed block's rerun uses its forward's scales, so gradients are the
// same bits as without recomputation.
TEST_F(Fp8TrainingTest, KeptFloat32LayersOptOutAndRecomputationChangesNoBit) {
  Options options = fp8_options();
  auto master_grads = [&](bool recomputed, bool keep_fc2) {
    torch::manual_seed(4);
    Mlp model;
    amp::optim::FusedAdam optimizer(model->parameters());
    Options o = options;
    if (keep_fc2) o.keep_fp32 = [&model](const torch::nn::Module& m) { return &m == model->fc2.get(); };
    initialize(model, optimizer, quiet(o));
    const at::Tensor x = torch::randn({16, 32});
    auto middle = [&](const at::Tensor& h) { return torch::relu(model->fc2(torch::relu(model->fc1(h)))); };
    const at::Tensor hidden = recomputed ? recompute(middle, x) : middle(x);
    {
      scale_loss scaled(model->fc3(hidden).to(at::kFloat).pow(2).mean(), optimizer);
      scaled.backward();
    }
    std::vector<at::Tensor> grads;
    for (const auto& p : master_params(optimizer)) grads.push_back(p.grad().clone());
    const int64_t sites = detail::live_context()->fp8()->sites();
    deinitialize();
    return std::make_pair(grads, sites);
  };
  const auto [kept, kept_sites] = master_grads(false, true);
  EXPECT_EQ(kept_sites, 2);  // fc1 and fc3; fc2 ran in float32
  const auto [plain, plain_sites] = master_grads(false, false);
  const auto [rerun, rerun_sites] = master_grads(true, false);
  EXPECT_EQ(plain_sites, 3);
  EXPECT_EQ(rerun_sites, 3);
  ASSERT_EQ(plain.size(), rerun.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(BitEqual(rerun[i], plain[i])) << "gradient " << i;
}


// A custom autograd function that asks for float32 (custom_fwd) keeps its
// GEMMs out of float8, as it keeps them out of bfloat16.
struct Fp32Projection : torch::autograd::Function<Fp32Projection> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, at::Tensor weight) {
    custom_fwd fwd(ctx, at::kFloat);
    x = fwd.cast(x), weight = fwd.cast(weight);
    ctx->save_for_backward({x, weight});
    return torch::mm(x, weight.t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    custom_bwd bwd(ctx);
    const auto saved = ctx->get_saved_variables();
    return {grads[0].mm(saved[1]), grads[0].t().mm(saved[0])};
  }
};

// A weight read through several views - heads chunked from one table - is
// quantized as each view's own values: each head's product, and the
// gradient through both, within float8's rounding of float64's. (The views
// share their weight's version, so a quantization kept for the weight alone
// gave the second head the first's values.)
struct HeadsTableImpl : torch::nn::Module {
  HeadsTableImpl() : table(register_parameter("table", torch::randn({8, 8}))) {}
  at::Tensor forward(const at::Tensor& x) {
    const std::vector<at::Tensor> heads = table.chunk(2, /*dim=*/0);
    return torch::cat({x.matmul(heads[0].t()), x.matmul(heads[1].t())}, /*dim=*/1);
  }
  at::Tensor table;
};
TORCH_MODULE(HeadsTable);

TEST_F(Fp8TrainingTest, ViewsOfOneWeightAreQuantizedEachAsItsOwnValues) {
  torch::manual_seed(0);
  const at::Tensor init = torch::randn({8, 8}), x0 = torch::tanh(torch::randn({16, 8})), c = torch::randn({16, 8});
  HeadsTable model;
  {
    torch::NoGradGuard no_grad;
    model->table.copy_(init);
  }
  const at::Tensor table = init.to(at::kDouble);
  amp::optim::FusedSGD optimizer(model->parameters(), torch::optim::SGDOptions(0.0));
  initialize(model, optimizer, quiet(fp8_options()));
  const at::Tensor y = model->forward(x0);
  {
    scale_loss scaled((y.to(at::kFloat) * c).sum(), optimizer);
    scaled.backward();
  }
  const at::Tensor x64 = x0.to(at::kDouble), exact = x64.mm(table.t());
  for (int64_t head = 0; head < 2; ++head) {
    const at::Tensor got = y.to(at::kDouble).narrow(1, 4 * head, 4), want = exact.narrow(1, 4 * head, 4);
    EXPECT_LT((got - want).norm().item<double>(), 0.1 * want.norm().item<double>()) << "head " << head;
  }
  // The table's gradient (the optimizer's float32 master's, unscaled): c's columns of each head times x.
  const at::Tensor grad = optimizer.param_groups()[0].params()[0].grad().to(at::kDouble);
  const at::Tensor want_grad = c.to(at::kDouble).t().mm(x64);
  EXPECT_LT((grad - want_grad).norm().item<double>(), 0.15 * want_grad.norm().item<double>());
  deinitialize();
  // The GEMMs ran in float8: O5 without it computes other values.
  HeadsTable plain;
  {
    torch::NoGradGuard no_grad;
    plain->table.copy_(init);
  }
  amp::optim::FusedSGD plain_optimizer(plain->parameters(), torch::optim::SGDOptions(0.0));
  initialize(plain, plain_optimizer, quiet(O5));
  EXPECT_FALSE(plain->forward(x0).equal(y));
}

TEST_F(Fp8TrainingTest, CustomFwdInFloat32OptsOutOfFloat8) {
  Options options = fp8_options();
  Mlp model;
  amp::optim::FusedAdam optimizer(model->parameters());
  initialize(model, optimizer, quiet(options));
  const at::Tensor x = torch::randn({8, 32});
  const at::Tensor inside = Fp32Projection::apply(x, model->fc1->weight);
  EXPECT_EQ(inside.scalar_type(), at::kFloat);
  EXPECT_EQ(detail::live_context()->fp8()->sites(), 0);
  const at::Tensor outside = torch::mm(x, model->fc1->weight.t());  // the same GEMM under amp's casts
  EXPECT_EQ(outside.scalar_type(), at::kBFloat16);
  EXPECT_EQ(detail::live_context()->fp8()->sites(), 1);
}

}  // namespace
}  // namespace amp::testing
