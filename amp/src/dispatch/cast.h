// Private: casting one argument, and the per-call bookkeeping of the
// interception kernels. Mirrors the helpers of ATen's autocast_mode.h
// (is_eligible, cached_cast, promote_type, set_opt_dtype), with amp's cache.
#pragma once

#include <ATen/core/IListRef.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace amp::detail {

// Floating tensors of the kernel's device are cast; float64 never is (as in
// LibTorch's autocast).
inline bool is_castable(const at::Tensor& t, c10::DeviceType device) {
  if (!t.defined() || !t.is_floating_point() || t.scalar_type() == at::kDouble) return false;
  return device == c10::DeviceType::CUDA ? t.is_cuda() : (t.is_cpu() || t.is_mkldnn());
}

// The cast itself: through the cast cache when `t` is an fp32 leaf weight
// going to low precision, counted either way.
at::Tensor cast_uncached_or_cached(const at::Tensor& t, at::ScalarType to);

// Whether cast_arg(to, device, arg) would cast anything.
inline bool needs_cast(at::ScalarType to, c10::DeviceType device, const at::Tensor& t) {
  return is_castable(t, device) && t.scalar_type() != to;
}
inline bool needs_cast(at::ScalarType to, c10::DeviceType device, const std::optional<at::Tensor>& t) {
  return t.has_value() && needs_cast(to, device, *t);
}
inline bool needs_cast(at::ScalarType to, c10::DeviceType device, at::TensorList list) {
  return std::any_of(list.begin(), list.end(), [&](const at::Tensor& t) { return needs_cast(to, device, t); });
}
inline bool needs_cast(at::ScalarType to, c10::DeviceType device, const at::ITensorListRef& list) {
  return std::any_of(list.begin(), list.end(), [&](const at::Tensor& t) { return needs_cast(to, device, t); });
}
template <class T>
inline bool needs_cast(at::ScalarType, c10::DeviceType, const T&) {
  return false;
}

inline at::Tensor cast_arg(at::ScalarType to, c10::DeviceType device, const at::Tensor& t) {
  if (!needs_cast(to, device, t)) return t;
  return cast_uncached_or_cached(t, to);
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
  return arg;  // non-tensor arguments pass through
}

// kPromote: float32 wins over the low dtype; float64 is ignored.
inline at::ScalarType widen(at::ScalarType current, c10::DeviceType device, const at::Tensor& t) {
  if (!is_castable(t, device)) return current;
  return t.scalar_type() == at::kFloat ? at::kFloat : current;
}
inline at::ScalarType widen(at::ScalarType current, c10::DeviceType device, at::TensorList list) {
  for (const auto& t : list) current = widen(current, device, t);
  return current;
}
inline at::ScalarType widen(at::ScalarType current, c10::DeviceType device,
                            const at::ITensorListRef& list) {
  for (const auto& t : list) current = widen(current, device, t);
  return current;
}
template <class T>
inline at::ScalarType widen(at::ScalarType current, c10::DeviceType, const T&) {
  return current;
}
template <class... Args>
inline at::ScalarType promote_type(at::ScalarType low, c10::DeviceType device, const Args&... args) {
  at::ScalarType result = low;
  ((result = widen(result, device, args)), ...);
  return result;
}

// kLowerPrecision at O2/O3: the dtype of the first weight among the
// arguments (a floating leaf that requires grad).
inline std::optional<at::ScalarType> weight_dtype_of(c10::DeviceType device, const at::Tensor& t) {
  if (is_castable(t, device) && t.requires_grad() && t.is_leaf()) return t.scalar_type();
  return std::nullopt;
}
inline std::optional<at::ScalarType> weight_dtype_of(c10::DeviceType device,
                                                     const std::optional<at::Tensor>& t) {
  return t.has_value() ? weight_dtype_of(device, *t) : std::nullopt;
}
template <class T>
inline std::optional<at::ScalarType> weight_dtype_of(c10::DeviceType, const T&) {
  return std::nullopt;
}
template <class... Args>
inline at::ScalarType weights_dtype(at::ScalarType low, c10::DeviceType device, const Args&... args) {
  std::optional<at::ScalarType> found;
  ((found = found ? found : weight_dtype_of(device, args)), ...);
  return found.value_or(low);
}

// kMatchParameters: what the floating arguments hold, folded over them.
struct ParameterMix {
  std::optional<at::ScalarType> low;  // the first low-precision dtype seen
  bool fp32 = false;                  // some float32 argument
  bool fp32_parameter = false;        // some float32 leaf that requires grad

  void see(c10::DeviceType device, const at::Tensor& t) {
    if (!is_castable(t, device)) return;
    if (t.scalar_type() == at::kFloat) {
      fp32 = true;
      fp32_parameter = fp32_parameter || (t.requires_grad() && t.is_leaf());
    } else if (!low) {
      low = t.scalar_type();
    }
  }
  void see(c10::DeviceType device, const std::optional<at::Tensor>& t) {
    if (t) see(device, *t);
  }
  void see(c10::DeviceType device, at::TensorList list) {
    for (const auto& t : list) see(device, t);
  }
  void see(c10::DeviceType device, const at::ITensorListRef& list) {
    for (const auto& t : list) see(device, t);
  }
  template <class T>
  void see(c10::DeviceType, const T&) {}

  // The dtype to cast float32 arguments to: the parameters' low dtype when
  // float32 activations meet them, nullopt when the call runs as given.
  std::optional<at::ScalarType> target() const {
    return low && fp32 && !fp32_parameter ? low : std::nullopt;
  }
};

template <class... Args>
inline std::optional<at::ScalarType> parameter_dtype(c10::DeviceType device, const Args&... args) {
  ParameterMix mix;
  (mix.see(device, args), ...);
  return mix.target();
}

// kFp32SetOptDtype: keep a dtype the caller chose, else ask for float32.
inline std::optional<at::ScalarType> set_opt_dtype(const std::optional<at::ScalarType>& dtype) {
  return dtype.has_value() ? dtype : at::kFloat;
}
template <class T>
inline T set_opt_dtype(T arg) {
  return arg;
}

template <class... Rest>
inline bool first_arg_castable(c10::DeviceType device, const at::Tensor& first, const Rest&...) {
  return is_castable(first, device);
}
template <class First, class... Rest>
inline bool first_arg_castable(c10::DeviceType, const First&, const Rest&...) {
  return false;
}

// True while the autograd engine runs a backward pass on this thread: amp
// never casts there, so backward ops run in the dtypes forward recorded.
bool in_backward();

}  // namespace amp::detail
