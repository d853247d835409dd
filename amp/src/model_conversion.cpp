#include <amp/model_conversion.h>

#include <amp/opt_levels.h>

#include <c10/util/Exception.h>
#include <torch/nn/modules/batchnorm.h>

#include <ATen/core/grad_mode.h>

namespace amp {
namespace {

template <class Impl>
bool affine_batchnorm_as(const torch::nn::Module& module) {
  const auto* bn = dynamic_cast<const Impl*>(&module);
  return bn != nullptr && bn->options.affine();
}

// Converts one tensor in place: same TensorImpl, new data, so optimizers and
// other references keep pointing at it.
at::Tensor convert_in_place(at::Tensor& t, c10::ScalarType dtype) {
  // variable_data(): the fp32 data with its own version counter, so updates
  // of a master built from it do not count as edits of the parameter.
  at::Tensor original = t.variable_data();
  t.set_data(original.to(dtype));
  return original;
}

}  // namespace

bool is_affine_batchnorm(const torch::nn::Module& module) {
  return affine_batchnorm_as<torch::nn::BatchNorm1dImpl>(module) ||
         affine_batchnorm_as<torch::nn::BatchNorm2dImpl>(module) ||
         affine_batchnorm_as<torch::nn::BatchNorm3dImpl>(module);
}

std::vector<ConvertedParameter> convert_model(
    torch::nn::Module& model, c10::ScalarType dtype, bool keep_batchnorm_fp32,
    const std::function<bool(const torch::nn::Module&)>& keep_fp32) {
  TORCH_CHECK(is_low_precision(dtype),
              "amp: convert_model converts to float16 or bfloat16, got ", dtype);
  at::NoGradGuard no_grad;
  std::vector<ConvertedParameter> converted;
  std::vector<std::shared_ptr<torch::nn::Module>> modules = model.modules(/*include_self=*/false);
  std::vector<torch::nn::Module*> all{&model};
  for (const auto& m : modules) all.push_back(m.get());
  for (torch::nn::Module* module : all) {
    if (keep_batchnorm_fp32 && is_affine_batchnorm(*module)) continue;
    if (keep_fp32 && keep_fp32(*module)) continue;
    for (auto& param : module->named_parameters(/*recurse=*/false)) {
      if (!param.value().is_floating_point() || param.value().scalar_type() == dtype) continue;
      at::Tensor original = convert_in_place(param.value(), dtype);
      converted.push_back({param.value(), original});
    }
    for (auto& buffer : module->named_buffers(/*recurse=*/false)) {
      if (buffer.value().is_floating_point()) convert_in_place(buffer.value(), dtype);
    }
  }
  return converted;
}

}  // namespace amp
