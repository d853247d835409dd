// The opt-level table: each level's properties, as Apex defines them (with
// Apex-ROCm's bf16 levels O4/O5).
#include "levels.h"
#include <amp/internal/level_rules.h>

#include <c10/util/Exception.h>

#include <sstream>

namespace amp {

const std::vector<LevelDefaults>& level_table() {
  static const std::vector<LevelDefaults> table = {
      // level name  model cast                patch  keep BN fp32   masters       static scale  bf16  fp16 twin     stochastic note
      {O0, "O0", ModelCast::kFloat32,      false, std::nullopt, false,        1.0,          false, std::nullopt, false, ""},
      {O1, "O1", ModelCast::kNone,         true,  std::nullopt, std::nullopt, std::nullopt, false, std::nullopt, false, ""},
      {O2, "O2", ModelCast::kLowPrecision, false, true,         true,         std::nullopt, false, std::nullopt, false, ""},
      {O3, "O3", ModelCast::kLowPrecision, false, false,        false,        1.0,          false, std::nullopt, false, ""},
      {O4, "O4", ModelCast::kNone,         true,  std::nullopt, std::nullopt, 1.0,          true,  O1,           false, "O1 in bfloat16"},
      {O5, "O5", ModelCast::kLowPrecision, false, true,         true,         1.0,          true,  O2,           false, "O2 in bfloat16"},
      {O6, "O6", ModelCast::kLowPrecision, false, true,         false,        1.0,          true,  std::nullopt, true,  "bfloat16 without float32 masters"},
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
      << "  fp8                   " << (p.fp8 ? "True (linear GEMMs in float8)" : "False") << "\n"
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
