// Private: the per-level defaults table shared by levels.cpp and validate.cpp.
#pragma once

#include <amp/opt_levels.h>

namespace amp {

// What a level does to the model's floating parameters and buffers.
enum class ModelCast : uint8_t {
  kNone,          // untouched (O1): casts happen per op
  kFloat32,       // checked to be fp32 (O0)
  kLowPrecision,  // converted to the device's low-precision dtype (O2, O3)
};

struct LevelDefaults {
  OptLevel level;
  ModelCast model_cast;
  bool patch_torch_functions;
  std::optional<bool> keep_batchnorm_fp32;
  std::optional<bool> master_weights;
  std::optional<double> static_loss_scale;  // nullopt: dynamic
  bool bfloat16_only;                       // O4, O5
};

const LevelDefaults& level_defaults(OptLevel level);

}  // namespace amp
