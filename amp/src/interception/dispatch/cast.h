// SPDX-License-Identifier: BSD-3-Clause
// Private: the argument side of the interception kernels - which tensors
// are cast, the cast itself, and a uniform walk over the tensors of a call.
// Mirrors the helpers of ATen's autocast_mode.h (is_eligible, cached_cast),
// with amp's cache.
#pragma once

#include <ATen/core/IListRef.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace amp::detail {

// Floating tensors of the kernel's device are cast; float64 never is (as in
// LibTorch's autocast).
C10_ALWAYS_INLINE bool is_castable(const at::Tensor& t, c10::DeviceType device) {
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
  if (list.isUnboxed()) return visit_tensors(list.toUnboxed(), fn);  // no per-element tag switch
  for (const auto& t : list) fn(t, /*in_list=*/true);
}
template <class T, class Fn>
void visit_tensors(const T&, Fn&) {}

// The tensors a kernel's result holds: one return or a tuple of them.
template <class... Ts>
std::vector<at::Tensor> result_tensors(const std::tuple<Ts...>& result) {
  std::vector<at::Tensor> out;
  auto add = [&](const at::Tensor& t, bool) { out.push_back(t); };
  std::apply([&](const auto&... items) { (visit_tensors(items, add), ...); }, result);
  return out;
}
template <class T>
std::vector<at::Tensor> result_tensors(const T& result) {
  std::vector<at::Tensor> out;
  auto add = [&](const at::Tensor& t, bool) { out.push_back(t); };
  visit_tensors(result, add);
  return out;
}

bool in_backward();

// Which of one call's arguments are cast to `to`. Whether backward is
// running (no casts there) is asked once, at the first argument that would
// be cast, so calls that cast nothing never ask.
class CastCheck {
 public:
  CastCheck(at::ScalarType to, c10::DeviceType device) : to_(to), device_(device) {}

  at::ScalarType to() const { return to_; }
  bool casts(const at::Tensor& t) {
    if (!needs_cast(to_, device_, t)) return false;
    if (allowed_ == Allowed::kUnknown) allowed_ = in_backward() ? Allowed::kNo : Allowed::kYes;
    return allowed_ == Allowed::kYes;
  }

 private:
  enum class Allowed : uint8_t { kUnknown, kYes, kNo };
  at::ScalarType to_;
  c10::DeviceType device_;
  Allowed allowed_ = Allowed::kUnknown;
};

// Casts a typed call's arguments as they are passed on: `Op::call(cast(args)...)`
// is the call's one walk over its arguments, as ATen's cached_cast makes. An
// argument not cast is passed by reference, uncopied; a cast one is kept in
// one of `kTensors` slots (one per tensor or optional tensor argument) or
// `kLists` lists until the call returns.
template <size_t kTensors, size_t kLists>
class ArgCast : public CastCheck {
 public:
  using CastCheck::CastCheck;

  const at::Tensor& operator()(const at::Tensor& t) {
    if (!casts(t)) return t;
    return tensors_[next_tensor_++].emplace(cast_uncached_or_cached(t, to()));
  }
  const std::optional<at::Tensor>& operator()(const std::optional<at::Tensor>& t) {
    if (!t.has_value() || !casts(*t)) return t;
    std::optional<at::Tensor>& slot = tensors_[next_tensor_++];
    slot.emplace(cast_uncached_or_cached(*t, to()));
    return slot;
  }
  at::TensorList operator()(at::TensorList list) {
    const std::vector<at::Tensor>* cast = cast_list(list);
    return cast != nullptr ? at::TensorList(*cast) : list;
  }
  at::ITensorListRef operator()(const at::ITensorListRef& list) {
    const std::vector<at::Tensor>* cast = list.isUnboxed() ? cast_list(list.toUnboxed()) : cast_list(list);
    return cast != nullptr ? at::ITensorListRef(*cast) : list;
  }
  template <class T>
  const T& operator()(const T& arg) {
    return arg;
  }

 private:
  // `list` with its casts, in a list slot, built from the first element cast
  // on; nullptr when nothing in it is cast.
  template <class List>
  const std::vector<at::Tensor>* cast_list(const List& list) {
    for (auto it = list.begin(); it != list.end(); ++it) {
      if (!casts(*it)) continue;
      std::vector<at::Tensor>& out = lists_[next_list_++];
      out.reserve(list.size());
      for (auto kept = list.begin(); kept != it; ++kept) out.push_back(*kept);
      out.push_back(cast_uncached_or_cached(*it, to()));
      while (++it != list.end()) out.push_back(casts(*it) ? cast_uncached_or_cached(*it, to()) : *it);
      return &out;
    }
    return nullptr;
  }

  std::array<std::optional<at::Tensor>, kTensors> tensors_;
  std::array<std::vector<at::Tensor>, kLists> lists_;
  size_t next_tensor_ = 0, next_list_ = 0;
};

// The slots ArgCast needs for a signature's arguments.
template <class T>
constexpr bool kIsTensorArg = std::is_same_v<std::decay_t<T>, at::Tensor> ||
                              std::is_same_v<std::decay_t<T>, std::optional<at::Tensor>>;
template <class T>
constexpr bool kIsListArg = std::is_same_v<std::decay_t<T>, at::TensorList> ||
                            std::is_same_v<std::decay_t<T>, at::ITensorListRef>;
template <class... Args>
using ArgCastFor = ArgCast<(size_t{kIsTensorArg<Args>} + ... + 0), (size_t{kIsListArg<Args>} + ... + 0)>;

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
void allow_casts_in_backward(bool allow);

// True while a recomputed block reruns its forward on this thread
// (recompute.h): amp's kernels cast as in forward, and op statistics leave
// the calls out (forward counted them). set_recomputing nests.
bool recomputing();
void set_recomputing(bool on);

}  // namespace amp::detail
