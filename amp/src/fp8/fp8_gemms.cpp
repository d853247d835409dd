#include "fp8/fp8_gemms.h"

#include <ATen/ATen.h>

namespace amp::detail {

Fp8Gemms::Fp8Gemms(const Options::Fp8Scaling& recipe)
    : recipe_(recipe),
      forward_(at::kFloat8_e4m3fn),
      backward_(recipe.format == Options::Fp8Scaling::Format::kHybrid ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn) {}

at::Tensor Fp8Gemms::linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const c10::TensorImpl* layer) {
  if (!fp8_shapes_fit(input, weight)) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++fallbacks_;
    }
    return at::linear(input, weight, bias);
  }
  std::shared_ptr<Fp8Site> site;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = sites_[layer];
    if (!slot) slot = std::make_shared<Fp8Site>(recipe_, forward_, backward_);
    site = slot;
  }
  return fp8_linear(input, weight, bias, std::move(site));
}

void Fp8Gemms::update() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [weight, site] : sites_) {
    site->input.update();
    site->weight.update();
    site->grad_output.update();
  }
}

int64_t Fp8Gemms::sites() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(sites_.size());
}

int64_t Fp8Gemms::fallbacks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fallbacks_;
}

std::shared_ptr<Fp8Site> Fp8Gemms::site_of(const at::Tensor& weight) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sites_.find(weight.unsafeGetTensorImpl());
  return it == sites_.end() ? nullptr : it->second;
}

}  // namespace amp::detail
