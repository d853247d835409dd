// SPDX-License-Identifier: BSD-3-Clause
// Internal: the rules behind the opt-level table (opt_levels.h) - resolving
// a level with its overrides, checking the scaler's knobs, the dtypes amp
// computes in. amp::initialize applies them; programs see the result in
// amp::properties().
#pragma once

#include <amp/opt_levels.h>

#include <vector>

namespace amp::internal {

// Every level, in table order.
std::vector<OptLevel> all_opt_levels();

// float16 or bfloat16: the dtypes amp computes in. Inline: every casting
// call asks.
inline bool is_low_precision(c10::ScalarType dtype) { return dtype == c10::kHalf || dtype == c10::kBFloat16; }

// Applies `overrides` to `level`'s defaults and validates the result (the
// errors listed in opt_levels.h). The model's device picks O2/O3's
// cast_model_type (its low-precision dtype).
Properties resolve_properties(OptLevel level, const PropertyOverrides& overrides,
                              c10::DeviceType model_device = c10::DeviceType::CUDA);

// Throws c10::Error naming the field when a knob is out of range (the
// ranges listed in opt_levels.h); Options and LossScaler::set_dynamic_scaling
// use it.
void check_dynamic_scaling(const DynamicScaling& scaling);

}  // namespace amp::internal
