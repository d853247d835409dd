#include "optim/held_gradients.h"

namespace amp::detail {

void HeldGradients::take(const at::Tensor& param) {
  at::Tensor& grad = param.mutable_grad();
  held_.emplace_back(param, at::Tensor());  // (if this throws, nothing moved)
  held_.back().second = std::exchange(grad, at::Tensor());
}

void HeldGradients::give_back() noexcept {
  for (auto& [param, grad] : held_) param.mutable_grad() = std::move(grad);
  held_.clear();
}

}  // namespace amp::detail
