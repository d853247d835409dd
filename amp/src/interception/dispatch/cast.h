// Private: the argument side of the interception kernels - which tensors
// are cast, the cast itself, and a uniform walk over the tensors of a call.
// Mirrors the helpers of ATen's autocast_mode.h (is_eligible, cached_cast),
// with amp's cache.
#pragma once

#include <ATen/core/IListRef.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <vector>

namespace amp::detail {

// Floating tensors of the kernel's device are cast; float64 never is (as in
// LibTorch's autocast).
inline bool is_castable(const at::Tensor& t, c10::DeviceType device) {
  if (!t.defined()) return false;
  const at::ScalarType dtype = t.scalar_type();  // inline, unlike Tensor::is_floating_point()
  if (!c10::isFloatingType(dtype) || dtype == at::kDouble) return false;
  return device == c10::DeviceType::CUDA ? t.is_cuda() : (t.is_cpu() || t.is_mkldnn());
}

inline bool needs_cast(at::ScalarType to, c10::DeviceType device, const at::Tensor& t) {
  return is_castable(t, device) && t.scalar_type() != to;
}

// The cast itself: through the cast cache when `t` is an fp32 leaf weight
// going to low precision, counted either way.
at::Tensor cast_uncached_or_cached(const at::Tensor& t, at::ScalarType to);

// Calls fn(tensor, in_list) for every tensor an argument holds: a tensor, a
// present optional tensor, or each element of a tensor list. Other
// arguments hold none.
template <class Fn>
void visit_tensors(const at::Tensor& t, Fn& fn) {
  fn(t, /*in_list=*/false);
}
template <class Fn>
void visit_tensors(const std::optional<at::Tensor>& t, Fn& fn) {
  if (t.has_value()) fn(*t, /*in_list=*/false);
}
template <class Fn>
void visit_tensors(at::TensorList list, Fn& fn) {
  for (const auto& t : list) fn(t, /*in_list=*/true);
}
template <class Fn>
void visit_tensors(const at::ITensorListRef& list, Fn& fn) {
  for (const auto& t : list) fn(t, /*in_list=*/true);
}
template <class T, class Fn>
void visit_tensors(const T&, Fn&) {}

// An argument cast to `to` where it is castable; others pass through.
inline at::Tensor cast_arg(at::ScalarType to, c10::DeviceType device, const at::Tensor& t) {
  return needs_cast(to, device, t) ? cast_uncached_or_cached(t, to) : t;
}
inline std::optional<at::Tensor> cast_arg(at::ScalarType to, c10::DeviceType device,
                                          const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return cast_arg(to, device, *t);
}
inline std::vector<at::Tensor> cast_arg(at::ScalarType to, c10::DeviceType device,
                                        at::TensorList list) {
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (const auto& t : list) out.push_back(cast_arg(to, device, t));
  return out;
}
inline std::vector<at::Tensor> cast_arg(at::ScalarType to, c10::DeviceType device,
                                        const at::ITensorListRef& list) {
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (const auto& t : list) out.push_back(cast_arg(to, device, t));
  return out;
}
template <class T>
inline T cast_arg(at::ScalarType, c10::DeviceType, T arg) {
  return arg;
}

// kFp32SetOptDtype on typed arguments: keep a dtype the caller chose, else
// ask for float32.
inline std::optional<at::ScalarType> set_opt_dtype(const std::optional<at::ScalarType>& dtype) {
  return dtype.has_value() ? dtype : at::kFloat;
}
template <class T>
inline T set_opt_dtype(T arg) {
  return arg;
}

// True while the autograd engine runs a backward pass on this thread: amp
// never casts there, so backward ops run in the dtypes forward recorded -
// except inside a custom_bwd whose forward cast (custom_function.h), which
// allows casts for its extent (nested counts).
bool in_backward();
void allow_casts_in_backward(bool allow);

}  // namespace amp::detail
