// SPDX-License-Identifier: BSD-3-Clause
#include "optim/held_gradients.h"

namespace amp::detail {

void HeldGradients::index_all() {
  for (; indexed_ < held_.size(); ++indexed_) index_.emplace(held_[indexed_].first.unsafeGetTensorImpl(), indexed_);
}

const at::Tensor& HeldGradients::take(const at::Tensor& param) {
  index_all();
  at::Tensor& grad = param.mutable_grad();
  auto found = index_.find(param.unsafeGetTensorImpl());
  if (found != index_.end()) {
    grad = at::Tensor();
    return held_[found->second].second;
  }
  held_.emplace_back(param, at::Tensor());  // (if this throws, nothing moved)
  index_all();
  held_.back().second = std::exchange(grad, at::Tensor());
  return held_.back().second;
}

const at::Tensor& HeldGradients::take_new(const at::Tensor& param) {
  held_.emplace_back(param, std::exchange(param.mutable_grad(), at::Tensor()));  // room reserved: cannot throw
  return held_.back().second;
}

void HeldGradients::put(const at::Tensor& param, at::Tensor grad) {
  index_all();
  auto found = index_.find(param.unsafeGetTensorImpl());
  if (found != index_.end()) {
    held_[found->second].second = std::move(grad);
    return;
  }
  held_.emplace_back(param, std::move(grad));
  index_all();
}

at::Tensor HeldGradients::find(const at::Tensor& param) const {
  const c10::TensorImpl* impl = param.unsafeGetTensorImpl();
  auto found = index_.find(impl);
  if (found != index_.end()) return held_[found->second].second;
  for (size_t i = indexed_; i < held_.size(); ++i) {  // those take_new left out
    if (held_[i].first.unsafeGetTensorImpl() == impl) return held_[i].second;
  }
  return at::Tensor();
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
  if (indexed_ > 0) index_.clear();  // (clearing walks every bucket: skipped when none was filled)
  indexed_ = 0;
}

}  // namespace amp::detail
