// The opt-level table: each level's properties, as Apex defines them (with
// Apex-ROCm's bf16 levels O4/O5).
#include "levels.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace amp {
namespace {

constexpr LevelDefaults kLevels[] = {
    // level  model cast                patch  keep BN fp32   master weights  static scale  bf16 only
    {O0, ModelCast::kFloat32,      false, std::nullopt, false,          1.0,          false},
    {O1, ModelCast::kNone,         true,  std::nullopt, std::nullopt,   std::nullopt, false},
    {O2, ModelCast::kLowPrecision, false, true,         true,           std::nullopt, false},
    {O3, ModelCast::kLowPrecision, false, false,        false,          1.0,          false},
    {O4, ModelCast::kNone,         true,  std::nullopt, std::nullopt,   1.0,          true},
    {O5, ModelCast::kLowPrecision, false, true,         true,           1.0,          true},
};

constexpr const char* kNames[] = {"O0", "O1", "O2", "O3", "O4", "O5"};

}  // namespace

const LevelDefaults& level_defaults(OptLevel level) {
  return kLevels[static_cast<int>(level)];
}

const char* to_string(OptLevel level) { return kNames[static_cast<int>(level)]; }

OptLevel parse_opt_level(std::string_view name) {
  for (int i = 0; i < static_cast<int>(std::size(kNames)); ++i) {
    if (name == kNames[i]) return static_cast<OptLevel>(i);
  }
  TORCH_CHECK(false, "amp: unexpected optimization level '", name,
              "'. Options are 'O0', 'O1', 'O2', 'O3', 'O4' (O1 in bfloat16) and "
              "'O5' (O2 in bfloat16). Note that in 'O0', 'O1', etc., the prefix O is "
              "the capital letter O, not the number zero.");
}

std::string describe(const Properties& p) {
  auto dtype = [](const std::optional<c10::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("None");
  };
  std::ostringstream out;
  out << "amp: opt_level " << to_string(p.opt_level) << "\n"
      << "  cast_model_type       " << dtype(p.cast_model_type) << "\n"
      << "  patch_torch_functions " << (p.patch_torch_functions ? "True" : "False") << "\n"
      << "  keep_batchnorm_fp32   " << (p.keep_batchnorm_fp32 ? "True" : "False") << "\n"
      << "  master_weights        " << (p.master_weights ? "True" : "False") << "\n"
      << "  loss_scale            "
      << (p.loss_scale.dynamic ? "dynamic" : std::to_string(p.loss_scale.value)) << "\n"
      << "  cast_model_outputs    " << c10::toString(p.cast_model_outputs) << "\n"
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
