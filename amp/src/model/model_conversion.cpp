// SPDX-License-Identifier: BSD-3-Clause
#include <amp/model_conversion.h>
#include <amp/internal/level_rules.h>

#include <amp/opt_levels.h>

#include "model/module_walk.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules/batchnorm.h>

#include <ATen/core/grad_mode.h>

#include <unordered_set>

namespace amp {
namespace {

template <class Impl>
bool affine_batchnorm_as(const torch::nn::Module& module) {
  const auto* bn = dynamic_cast<const Impl*>(&module);
  return bn != nullptr && bn->options.affine();
}

}  // namespace

bool is_affine_batchnorm(const torch::nn::Module& module) {
  return affine_batchnorm_as<torch::nn::BatchNorm1dImpl>(module) ||
         affine_batchnorm_as<torch::nn::BatchNorm2dImpl>(module) ||
         affine_batchnorm_as<torch::nn::BatchNorm3dImpl>(module);
}

std::vector<LoweredTensor> lowered_tensors(
    torch::nn::Module& model, bool keep_batchnorm_fp32,
    const std::function<bool(const torch::nn::Module&)>& keep_fp32) {
  std::vector<LoweredTensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;  // shared (tied) tensors once
  detail::for_each_module(model, [&](const std::string& name, torch::nn::Module& module) {
    if (keep_batchnorm_fp32 && is_affine_batchnorm(module)) return;
    if (keep_fp32 && keep_fp32(module)) return;
    const std::string prefix = name.empty() ? "" : name + ".";
    auto add = [&](const std::string& name, const at::Tensor& t, bool is_buffer) {
      if (!t.defined() || !t.is_floating_point() || t.scalar_type() == at::kDouble) return;
      if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back({prefix + name, t, is_buffer});
    };
    for (const auto& p : module.named_parameters(/*recurse=*/false)) add(p.key(), p.value(), false);
    for (const auto& b : module.named_buffers(/*recurse=*/false)) add(b.key(), b.value(), true);
  });
  return out;
}

std::vector<ConvertedParameter> convert_model(
    torch::nn::Module& model, c10::ScalarType dtype, bool keep_batchnorm_fp32,
    const std::function<bool(const torch::nn::Module&)>& keep_fp32) {
  TORCH_CHECK(internal::is_low_precision(dtype),
              "amp: convert_model converts to float16 or bfloat16, got ", dtype);
  at::NoGradGuard no_grad;
  std::vector<ConvertedParameter> converted;
  for (LoweredTensor& lowered : lowered_tensors(model, keep_batchnorm_fp32, keep_fp32)) {
    at::Tensor& t = lowered.tensor;
    if (t.scalar_type() == dtype) continue;
    // variable_data(): the old data with its own version counter; the
    // tensor itself (its TensorImpl, which optimizers hold) gets new data.
    at::Tensor original = t.variable_data();
    t.set_data(original.to(dtype));
    if (!lowered.is_buffer) converted.push_back({t, original});
  }
  return converted;
}

}  // namespace amp
