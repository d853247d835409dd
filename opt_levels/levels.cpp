// SPDX-License-Identifier: BSD-3-Clause
// The opt-level table: each level's properties, as Apex defines them (with
// Apex-ROCm's bf16 levels O4/O5).
#include "levels.h"
#include <amp/internal/level_rules.h>

#include <c10/util/Exception.h>

#include <sstream>

namespace amp {

const std::vector<LevelDefaults>& level_table() {
  // Designated initializers (C++20: this target's standard), each row naming
  // what differs from LevelDefaults' defaults.
  static const std::vector<LevelDefaults> table = {
      {.level = O0,
       .name = "O0",
       .model_cast = ModelCast::kFloat32,
       .master_weights = false,
       .static_loss_scale = 1.0},
      {.level = O1, .name = "O1", .patch_torch_functions = true},
      {.level = O2,
       .name = "O2",
       .model_cast = ModelCast::kLowPrecision,
       .keep_batchnorm_fp32 = true,
       .master_weights = true},
      {.level = O3,
       .name = "O3",
       .model_cast = ModelCast::kLowPrecision,
       .keep_batchnorm_fp32 = false,
       .master_weights = false,
       .static_loss_scale = 1.0},
      {.level = O4,
       .name = "O4",
       .patch_torch_functions = true,
       .static_loss_scale = 1.0,
       .bfloat16_only = true,
       .float16_level = O1,
       .note = "O1 in bfloat16"},
      {.level = O5,
       .name = "O5",
       .model_cast = ModelCast::kLowPrecision,
       .keep_batchnorm_fp32 = true,
       .master_weights = true,
       .static_loss_scale = 1.0,
       .bfloat16_only = true,
       .float16_level = O2,
       .note = "O2 in bfloat16"},
      {.level = O6,
       .name = "O6",
       .model_cast = ModelCast::kLowPrecision,
       .keep_batchnorm_fp32 = true,
       .master_weights = false,
       .static_loss_scale = 1.0,
       .bfloat16_only = true,
       .stochastic_rounding = true,
       .note = "bfloat16 without float32 masters"},
  };
  return table;
}

const LevelDefaults& level_defaults(OptLevel level) {
  for (const LevelDefaults& row : level_table()) {
    if (row.level == level) return row;
  }
  TORCH_CHECK(false, "amp: opt level ", static_cast<int>(level), " has no row in the level table");
}

const char* to_string(OptLevel level) { return level_defaults(level).name; }

std::vector<OptLevel> internal::all_opt_levels() {
  std::vector<OptLevel> levels;
  for (const LevelDefaults& row : level_table()) levels.push_back(row.level);
  return levels;
}

OptLevel parse_opt_level(std::string_view name) {
  std::ostringstream options;
  for (const LevelDefaults& row : level_table()) {
    if (name == row.name) return row.level;
    options << (row.level == level_table().front().level ? "" : ", ") << "'" << row.name << "'";
    if (*row.note) options << " (" << row.note << ")";
  }
  TORCH_CHECK(false, "amp: unexpected optimization level '", name, "'. Options are ", options.str(),
              ". Note that in 'O0', 'O1', etc., the prefix O is the capital letter O, not the "
              "number zero.");
}

std::string describe(const Properties& p) {
  auto dtype = [](const std::optional<c10::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("None");
  };
  std::ostringstream out;
  if (!p.enabled) {
    out << "amp: disabled (Options::enabled = false): plain float32, no casts, no loss scaling\n";
    return out.str();
  }
  out << "amp: opt_level " << to_string(p.opt_level) << "\n"
      << "  cast_model_type       " << dtype(p.cast_model_type) << "\n"
      << "  patch_torch_functions " << (p.patch_torch_functions ? "True" : "False") << "\n"
      << "  keep_batchnorm_fp32   " << (p.keep_batchnorm_fp32 ? "True" : "False") << "\n"
      << "  master_weights        " << (p.master_weights ? "True" : "False") << "\n"
      << "  loss_scale            "
      << (p.loss_scale.dynamic ? "dynamic" : std::to_string(p.loss_scale.value)) << "\n"
      << "  cast_model_outputs    " << c10::toString(p.cast_model_outputs) << "\n"
      << "  stochastic_rounding   " << (p.stochastic_rounding ? "True" : "False") << "\n"
      << "  optimizer_state_dtype "
      << (p.optimizer_state_dtype == c10::kByte ? "8-bit (uint8, blockwise)"
          : p.stochastic_rounding               ? c10::toString(p.optimizer_state_dtype)
                                                : "the weights' (or masters') dtype")
      << "\n"
      << "  fp8                   " << (p.fp8 ? "True (linear GEMMs in float8)" : "False") << "\n"
      << "  step_in_backward      " << (p.step_in_backward ? "True" : "False") << "\n"
      << "  low precision dtype   CPU " << c10::toString(p.cpu_dtype) << ", CUDA "
      << c10::toString(p.cuda_dtype) << "\n";
  return out.str();
}

c10::ScalarType Properties::low_precision_dtype(c10::DeviceType device) const {
  return device == c10::DeviceType::CUDA ? cuda_dtype : cpu_dtype;
}

bool Properties::intercepts_ops() const {
  return patch_torch_functions ||
         (cast_model_type.has_value() && *cast_model_type != c10::kFloat);
}

}  // namespace amp
