// SPDX-License-Identifier: BSD-3-Clause
#include "optim/held_gradients.h"

namespace amp::detail {

const at::Tensor& HeldGradients::take(const at::Tensor& param) {
  at::Tensor& grad = param.mutable_grad();
  auto found = index_.find(param.unsafeGetTensorImpl());
  if (found != index_.end()) {
    grad = at::Tensor();
    return held_[found->second].second;
  }
  held_.emplace_back(param, at::Tensor());  // (if this throws, nothing moved)
  index_.emplace(param.unsafeGetTensorImpl(), held_.size() - 1);
  held_.back().second = std::exchange(grad, at::Tensor());
  return held_.back().second;
}

void HeldGradients::put(const at::Tensor& param, at::Tensor grad) {
  auto found = index_.find(param.unsafeGetTensorImpl());
  if (found != index_.end()) {
    held_[found->second].second = std::move(grad);
    return;
  }
  held_.emplace_back(param, std::move(grad));
  index_.emplace(param.unsafeGetTensorImpl(), held_.size() - 1);
}

at::Tensor HeldGradients::find(const at::Tensor& param) const {
  auto found = index_.find(param.unsafeGetTensorImpl());
  return found == index_.end() ? at::Tensor() : held_[found->second].second;
}

void HeldGradients::reserve(size_t more) {
  held_.reserve(held_.size() + more);
  index_.reserve(held_.size() + more);
}

void HeldGradients::give_back() noexcept {
  for (auto& [param, grad] : held_) param.mutable_grad() = std::move(grad);
  clear();
}

void HeldGradients::clear() noexcept {
  held_.clear();
  index_.clear();
}

}  // namespace amp::detail
