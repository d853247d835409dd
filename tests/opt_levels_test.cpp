// SPDX-License-Identifier: BSD-3-Clause
// The opt-level table: every level's defaults, every override valid or not,
// the resolved properties and the error text.
#include "test_util.h"
#include <amp/internal/level_rules.h>

#include <cmath>
#include <filesystem>
#include <iomanip>
#include <fstream>
#include <map>
#include <regex>
#include <limits>

namespace amp::testing {
namespace {

struct Row {
  std::string name;
  OptLevel level;
  std::function<void(PropertyOverrides&)> override_with;
  c10::DeviceType device;
  // Expected on success ...
  std::optional<c10::ScalarType> cast_model_type;
  bool patch_torch_functions;
  bool keep_batchnorm_fp32;
  bool master_weights;
  bool dynamic;
  double scale;
  // ... or the error.
  std::string error = "";
};

void none(PropertyOverrides&) {}
constexpr auto kCpu = c10::DeviceType::CPU;
constexpr auto kCuda = c10::DeviceType::CUDA;
constexpr auto kNone = std::nullopt;

std::vector<Row> rows() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  return {
      // Defaults (Apex's table; low precision is the device's dtype).
      {"O0", O0, none, kCpu, at::kFloat, false, false, false, false, 1.0},
      {"O1", O1, none, kCpu, kNone, true, false, false, true, 65536.0},
      {"O2_cpu", O2, none, kCpu, at::kBFloat16, false, true, true, true, 65536.0},
      {"O2_cuda", O2, none, kCuda, at::kHalf, false, true, true, true, 65536.0},
      {"O3_cpu", O3, none, kCpu, at::kBFloat16, false, false, false, false, 1.0},
      {"O3_cuda", O3, none, kCuda, at::kHalf, false, false, false, false, 1.0},
      {"O4", O4, none, kCuda, kNone, true, false, false, false, 1.0},
      {"O5", O5, none, kCuda, at::kBFloat16, false, true, true, false, 1.0},
      {"O6", O6, none, kCuda, at::kBFloat16, false, true, false, false, 1.0},
      {"O6_fp32_state", O6, [](auto& o) { o.optimizer_state_dtype = at::kFloat; }, kCpu, at::kBFloat16, false, true, false, false, 1.0},
      {"O6_round_to_nearest", O6, [](auto& o) { o.stochastic_rounding = false; }, kCpu, at::kBFloat16, false, true, false, false, 1.0},
      {"O3_bf16_stochastic", O3, [](auto& o) { o.stochastic_rounding = true; }, kCpu, at::kBFloat16, false, false, false, false, 1.0},
      // Valid overrides.
      {"O2_keep_bn_false", O2, [](auto& o) { o.keep_batchnorm_fp32 = false; }, kCpu, at::kBFloat16, false, false, true, true, 65536.0},
      {"O3_keep_bn_true", O3, [](auto& o) { o.keep_batchnorm_fp32 = true; }, kCpu, at::kBFloat16, false, true, false, false, 1.0},
      {"O3_dynamic", O3, [](auto& o) { o.loss_scale = LossScale::Dynamic(); }, kCpu, at::kBFloat16, false, false, false, true, 65536.0},
      {"O0_dynamic", O0, [](auto& o) { o.loss_scale = LossScale::Dynamic(128); }, kCpu, at::kFloat, false, false, false, true, 128.0},
      {"O1_static", O1, [](auto& o) { o.loss_scale = LossScale::Static(128); }, kCpu, kNone, true, false, false, false, 128.0},
      {"O1_cast_fp32", O1, [](auto& o) { o.cast_model_type = at::kFloat; }, kCpu, at::kFloat, true, false, false, true, 65536.0},
      {"O1_no_patch", O1, [](auto& o) { o.patch_torch_functions = false; }, kCpu, kNone, false, false, false, true, 65536.0},
      {"O2_no_masters", O2, [](auto& o) { o.master_weights = false; }, kCpu, at::kBFloat16, false, true, false, true, 65536.0},
      {"O2_cuda_bf16", O2, [](auto& o) { o.cuda_dtype = at::kBFloat16; }, kCuda, at::kBFloat16, false, true, true, true, 65536.0},
      {"O2_cpu_fp16", O2, [](auto& o) { o.cpu_dtype = at::kHalf; }, kCpu, at::kHalf, false, true, true, true, 65536.0},
      {"O2_cast_half_explicit", O2, [](auto& o) { o.cast_model_type = at::kHalf; }, kCpu, at::kHalf, false, true, true, true, 65536.0},
      {"O2_max_clamps_init", O2, [](auto& o) { o.dynamic_scaling.max_loss_scale = 1024; }, kCpu, at::kBFloat16, false, true, true, true, 1024.0},
      {"O2_min_clamps_init", O2, [](auto& o) { o.loss_scale = LossScale::Dynamic(2); o.dynamic_scaling.min_loss_scale = 8; }, kCpu, at::kBFloat16, false, true, true, true, 8.0},
      // Invalid combinations (Apex's checks).
      {"O1_cast_half", O1, [](auto& o) { o.cast_model_type = at::kHalf; }, kCpu, kNone, 0, 0, 0, 0, 0, "use opt_level O2 or O3"},
      {"O4_cast_bf16", O4, [](auto& o) { o.cast_model_type = at::kBFloat16; }, kCpu, kNone, 0, 0, 0, 0, 0, "should remain float32"},
      {"O1_keep_bn", O1, [](auto& o) { o.keep_batchnorm_fp32 = true; }, kCpu, kNone, 0, 0, 0, 0, 0, "keep_batchnorm_fp32 must be left unset"},
      {"O1_keep_bn_false", O1, [](auto& o) { o.keep_batchnorm_fp32 = false; }, kCpu, kNone, 0, 0, 0, 0, 0, "keep_batchnorm_fp32 was false"},
      {"O1_masters", O1, [](auto& o) { o.master_weights = true; }, kCpu, kNone, 0, 0, 0, 0, 0, "master_weights make no sense"},
      {"O1_masters_false", O1, [](auto& o) { o.master_weights = false; }, kCpu, kNone, 0, 0, 0, 0, 0, "Leave master_weights unset"},
      {"O0_patch", O0, [](auto& o) { o.patch_torch_functions = true; }, kCpu, kNone, 0, 0, 0, 0, 0, "select opt_level O1"},
      {"O2_patch", O2, [](auto& o) { o.patch_torch_functions = true; }, kCpu, kNone, 0, 0, 0, 0, 0, "select opt_level O1"},
      {"O3_patch", O3, [](auto& o) { o.patch_torch_functions = true; }, kCpu, kNone, 0, 0, 0, 0, 0, "select opt_level O1"},
      {"O4_fp16", O4, [](auto& o) { o.cuda_dtype = at::kHalf; }, kCpu, kNone, 0, 0, 0, 0, 0, "use O1 for float16"},
      {"O5_fp16", O5, [](auto& o) { o.cpu_dtype = at::kHalf; }, kCpu, kNone, 0, 0, 0, 0, 0, "use O2 for float16"},
      {"dtype_float", O1, [](auto& o) { o.cpu_dtype = at::kFloat; }, kCpu, kNone, 0, 0, 0, 0, 0, "cpu_dtype must be float16"},
      {"cast_int", O2, [](auto& o) { o.cast_model_type = at::kInt; }, kCpu, kNone, 0, 0, 0, 0, 0, "cast_model_type must be float32"},
      {"scale_zero", O1, [](auto& o) { o.loss_scale = LossScale::Static(0); }, kCpu, kNone, 0, 0, 0, 0, 0, "a static loss scale must be a finite number > 0"},
      {"scale_negative", O1, [](auto& o) { o.loss_scale = LossScale::Dynamic(-4); }, kCpu, kNone, 0, 0, 0, 0, 0, "initial dynamic loss scale must be"},
      {"scale_inf", O1, [=](auto& o) { o.loss_scale = LossScale::Static(inf); }, kCpu, kNone, 0, 0, 0, 0, 0, "finite number > 0, got inf"},
      {"scale_nan", O1, [=](auto& o) { o.loss_scale = LossScale::Static(nan); }, kCpu, kNone, 0, 0, 0, 0, 0, "finite number > 0, got nan"},
      {"growth_one", O1, [](auto& o) { o.dynamic_scaling.growth_factor = 1.0; }, kCpu, kNone, 0, 0, 0, 0, 0, "growth_factor must be > 1"},
      {"backoff_one", O1, [](auto& o) { o.dynamic_scaling.backoff_factor = 1.0; }, kCpu, kNone, 0, 0, 0, 0, 0, "backoff_factor must lie in (0, 1)"},
      {"backoff_zero", O1, [](auto& o) { o.dynamic_scaling.backoff_factor = 0.0; }, kCpu, kNone, 0, 0, 0, 0, 0, "backoff_factor must lie in (0, 1)"},
      {"interval_zero", O1, [](auto& o) { o.dynamic_scaling.growth_interval = 0; }, kCpu, kNone, 0, 0, 0, 0, 0, "growth_interval must be >= 1"},
      {"hysteresis_zero", O1, [](auto& o) { o.dynamic_scaling.hysteresis = 0; }, kCpu, kNone, 0, 0, 0, 0, 0, "hysteresis must be >= 1"},
      {"min_above_max", O1, [](auto& o) { o.dynamic_scaling.min_loss_scale = 8; o.dynamic_scaling.max_loss_scale = 4; }, kCpu, kNone, 0, 0, 0, 0, 0, "must not exceed max_loss_scale"},
      {"min_zero", O1, [](auto& o) { o.dynamic_scaling.min_loss_scale = 0; }, kCpu, kNone, 0, 0, 0, 0, 0, "min_loss_scale must be a finite number > 0"},
      {"outputs_at_O1", O1, [](auto& o) { o.cast_model_outputs = at::kFloat; }, kCpu, kNone, 0, 0, 0, 0, 0, "cast_model_outputs applies to levels that cast the model"},
      {"O6_fp16", O6, [](auto& o) { o.cuda_dtype = at::kHalf; }, kCpu, kNone, 0, 0, 0, 0, 0, "O6 is a bfloat16 level"},
      {"O6_masters", O6, [](auto& o) { o.master_weights = true; }, kCpu, kNone, 0, 0, 0, 0, 0, "with master_weights (O6) the update lands in float32"},
      {"O5_stochastic", O5, [](auto& o) { o.stochastic_rounding = true; }, kCpu, kNone, 0, 0, 0, 0, 0, "Use opt_level O6, or master_weights=false"},
      {"O3_cuda_stochastic", O3, [](auto& o) { o.stochastic_rounding = true; }, kCuda, kNone, 0, 0, 0, 0, 0, "keeps the model in Half"},
      {"O1_stochastic", O1, [](auto& o) { o.stochastic_rounding = true; }, kCpu, kNone, 0, 0, 0, 0, 0, "keeps the model in float32 (cast per op)"},
      {"O2_state_dtype", O2, [](auto& o) { o.optimizer_state_dtype = at::kFloat; }, kCpu, kNone, 0, 0, 0, 0, 0, "optimizer_state_dtype applies with stochastic_rounding"},
      {"O6_state_half", O6, [](auto& o) { o.optimizer_state_dtype = at::kHalf; }, kCpu, kNone, 0, 0, 0, 0, 0, "optimizer_state_dtype must be float32 or bfloat16"},
      {"outputs_int", O2, [](auto& o) { o.cast_model_outputs = at::kInt; }, kCpu, kNone, 0, 0, 0, 0, 0, "must be float32 or the model's dtype"},
  };
}

class OptLevelTable : public ::testing::TestWithParam<Row> {};

TEST_P(OptLevelTable, ResolvesOrRejects) {
  const Row& row = GetParam();
  PropertyOverrides overrides;
  row.override_with(overrides);
  if (!row.error.empty()) {
    EXPECT_AMP_ERROR(internal::resolve_properties(row.level, overrides, row.device), row.error);
    return;
  }
  const Properties p = internal::resolve_properties(row.level, overrides, row.device);
  EXPECT_EQ(p.opt_level, row.level);
  EXPECT_EQ(p.cast_model_type, row.cast_model_type);
  EXPECT_EQ(p.patch_torch_functions, row.patch_torch_functions);
  EXPECT_EQ(p.keep_batchnorm_fp32, row.keep_batchnorm_fp32);
  EXPECT_EQ(p.master_weights, row.master_weights);
  EXPECT_EQ(p.loss_scale.dynamic, row.dynamic);
  EXPECT_EQ(p.loss_scale.value, row.scale);
  const bool stochastic = overrides.stochastic_rounding.value_or(row.level == O6);
  EXPECT_EQ(p.stochastic_rounding, stochastic);
  EXPECT_EQ(p.optimizer_state_dtype, overrides.optimizer_state_dtype.value_or(stochastic ? at::kBFloat16 : at::kFloat));
}

INSTANTIATE_TEST_SUITE_P(Rows, OptLevelTable, ::testing::ValuesIn(rows()),
                         [](const auto& info) { return info.param.name; });

// opt_levels.h documents the level table in a comment; levels.cpp holds it
// as data. The comment must say what the data does.
TEST(OptLevelDocs, HeaderTableSaysWhatTheLevelsResolveTo) {
  const auto header = std::filesystem::path(__FILE__).parent_path().parent_path() /
                      "opt_levels" / "include" / "amp" / "opt_levels.h";
  std::ifstream in(header);
  ASSERT_TRUE(in) << header;
  std::map<std::string, std::vector<std::string>> documented;  // "O2" -> its cells
  const std::regex row(R"(^///?\s+(O[0-9])\s{2,}(.*\S)\s*$)"), gap(R"(\s{2,})");
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (!std::regex_match(line, m, row)) continue;
    const std::string cells = m[2];
    documented[m[1]] = {std::sregex_token_iterator(cells.begin(), cells.end(), gap, -1), {}};
  }
  auto yes_no = [](bool b) { return std::string(b ? "true" : "false"); };
  auto one_decimal = [](double v) {
    std::ostringstream out;
    out << std::fixed << std::setprecision(1) << v;
    return out.str();
  };
  for (OptLevel level : internal::all_opt_levels()) {
    SCOPED_TRACE(to_string(level));
    const Properties cuda = internal::resolve_properties(level, {}, c10::kCUDA);
    const Properties cpu = internal::resolve_properties(level, {}, c10::kCPU);
    const bool casts_model = cuda.cast_model_type.has_value() && *cuda.cast_model_type != at::kFloat;
    std::string cast = "-";
    if (cuda.cast_model_type == at::kFloat) cast = "float32";
    if (casts_model) cast = cuda.cast_model_type == cpu.cast_model_type ? "bfloat16" : "low precision";
    const bool bf16 = cuda.cuda_dtype == at::kBFloat16;
    const std::vector<std::string> expected = {
        cast,
        cuda.patch_torch_functions ? (bf16 ? "true (bf16)" : "true") : "false",
        casts_model ? yes_no(cuda.keep_batchnorm_fp32) : "-",
        cuda.patch_torch_functions ? "-" : yes_no(cuda.master_weights),
        cuda.loss_scale.dynamic ? "dynamic" : one_decimal(cuda.loss_scale.value),
        yes_no(cuda.stochastic_rounding)};
    EXPECT_EQ(documented[std::string(to_string(level))], expected);
  }
}

TEST(OptLevelNames, ParseAcceptsTheLevelsAndExplainsTheLetterO) {
  ASSERT_EQ(internal::all_opt_levels().size(), 7u);
  for (OptLevel level : internal::all_opt_levels()) EXPECT_EQ(parse_opt_level(to_string(level)), level);
  for (const char* bad : {"o1", "0O", "01", "O9", "", "O1 "}) {
    EXPECT_AMP_ERROR(parse_opt_level(bad), "the prefix O is the capital letter O, not the number zero");
    EXPECT_AMP_ERROR(parse_opt_level(bad), "'O0', 'O1', 'O2', 'O3'");
  }
  EXPECT_AMP_ERROR(Options("O7"), "unexpected optimization level 'O7'");
  EXPECT_AMP_ERROR(parse_opt_level("O9"), "'O4' (O1 in bfloat16), 'O5' (O2 in bfloat16), 'O6' (bfloat16 "
                   "without float32 masters)");
}

TEST(OptLevelNames, DescribeListsTheResolvedProperties) {
  const std::string table = describe(internal::resolve_properties(O2, {}, c10::kCUDA));
  EXPECT_THAT(table, ::testing::HasSubstr("opt_level O2"));
  EXPECT_THAT(table, ::testing::HasSubstr("cast_model_type       Half"));
  EXPECT_THAT(table, ::testing::HasSubstr("keep_batchnorm_fp32   True"));
  EXPECT_THAT(table, ::testing::HasSubstr("loss_scale            dynamic"));
  EXPECT_THAT(describe(internal::resolve_properties(O6, {}, c10::kCPU)), ::testing::HasSubstr("stochastic_rounding   True"));
}

}  // namespace
}  // namespace amp::testing
