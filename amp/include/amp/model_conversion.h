// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Model conversion for O2/O3/O5: parameters and buffers to low precision,
/// except the modules that must stay float32.
///
/// amp::initialize calls this; it is public for users who convert models amp
/// does not train (e.g. an EMA copy) the same way.
///
/// ```
///   auto converted = amp::convert_model(*model, at::kHalf, /*keep_batchnorm_fp32=*/true);
/// ```
///
/// Every floating parameter and buffer of every submodule is converted in place
/// (the same tensors, new data), except
///   - affine BatchNorm1d/2d/3d when keep_batchnorm_fp32 (non-affine BatchNorm
///     has no parameters to protect and converts, as in Apex);
///   - modules for which keep_fp32 returns true (their own tensors; their
///     children are judged on their own).
///
/// Returns the converted parameters with their original float32 values (the
/// exact values, no copy), from which O2 builds its master weights.
///
/// Errors: dtype not float16/bfloat16. Parameters on several devices are
/// checked by initialize, not here.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <vector>

namespace amp {

/// A parameter convert_model lowered, with its float32 values.
struct ConvertedParameter {
  at::Tensor parameter;      ///< now in the low-precision dtype
  at::Tensor fp32_original;  ///< its float32 values before conversion
};

/// Converts `model` in place to `dtype` (float16 or bfloat16) by the rules
/// above; returns the converted parameters with their float32 originals.
std::vector<ConvertedParameter> convert_model(
    torch::nn::Module& model, c10::ScalarType dtype, bool keep_batchnorm_fp32,
    const std::function<bool(const torch::nn::Module&)>& keep_fp32 = {});

/// True for BatchNorm1d/2d/3d modules with affine parameters.
bool is_affine_batchnorm(const torch::nn::Module& module);

/// The floating parameters and buffers that a conversion lowers (the rule
/// above), with their names as named_parameters() / named_buffers() give
/// them, each tensor once.
struct LoweredTensor {
  std::string name;        ///< its name in the model: "fc1.weight", "bn.running_mean"
  at::Tensor tensor;       ///< the parameter or buffer itself
  bool is_buffer = false;  ///< a buffer, not a parameter
};
/// The tensors of `model` that convert_model(model, dtype,
/// keep_batchnorm_fp32, keep_fp32) lowers, without converting anything.
std::vector<LoweredTensor> lowered_tensors(
    torch::nn::Module& model, bool keep_batchnorm_fp32,
    const std::function<bool(const torch::nn::Module&)>& keep_fp32 = {});

}  // namespace amp
