// SPDX-License-Identifier: BSD-3-Clause
// Private: the opt-level table - the single source of each level's name,
// properties and hints, shared by levels.cpp and validate.cpp. Adding a level
// is one enum value in opt_levels.h and one row in levels.cpp.
#pragma once

#include <amp/opt_levels.h>

#include <optional>
#include <vector>

namespace amp {

// What a level does to the model's floating parameters and buffers.
enum class ModelCast : uint8_t {
  kNone,          // untouched: casts happen per op (O1, O4)
  kFloat32,       // checked to be fp32 (O0)
  kLowPrecision,  // converted to the device's low-precision dtype (O2, O3, O5, O6)
};

// One row of the table. Each property has its default here, so a row names
// only what its level sets, and a new property is one field (rows that keep
// its default stay as they are).
struct LevelDefaults {
  OptLevel level;
  const char* name;  // "O1": what users write, and what amp's state saves
  ModelCast model_cast = ModelCast::kNone;
  bool patch_torch_functions = false;
  std::optional<bool> keep_batchnorm_fp32 = std::nullopt;  // nullopt: Apex's None (false)
  std::optional<bool> master_weights = std::nullopt;  // nullopt: Apex's None (false)
  std::optional<double> static_loss_scale = std::nullopt;  // nullopt: dynamic
  bool bfloat16_only = false;
  // For a bfloat16-only level: the level that does the same in float16.
  std::optional<OptLevel> float16_level = std::nullopt;
  bool stochastic_rounding = false;  // updates land in the bf16 weights rounded stochastically
  const char* note = "";  // shown in the list of levels, e.g. "O1 in bfloat16"

  // O1-style levels keep the model fp32 and cast per op.
  bool casts_per_op() const { return model_cast == ModelCast::kNone; }
};

const LevelDefaults& level_defaults(OptLevel level);
const std::vector<LevelDefaults>& level_table();

}  // namespace amp
