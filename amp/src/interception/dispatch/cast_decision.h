// SPDX-License-Identifier: BSD-3-Clause
// Private: every cast policy, written once.
//
// A policy reads the tensors among an op's arguments and decides what the
// call does: run as given, cast the floating arguments to one dtype, ask for
// float32 through the op's own dtype argument, redirect to the op's dtype
// overload, or refuse. The typed kernel (one instantiation per ATen
// signature) and the boxed kernel (any schema) both ask decide() and differ
// only in how they apply the answer to their arguments - as ATen's
// autocast_mode.h writes one wrapper per CastPolicy.
//
// Backward never casts: ops there run in the dtypes forward recorded. Asking
// autograd costs a call, so decide() asks only where the answer would change
// the call.
#pragma once

#include "interception/dispatch/cast.h"
#include "model/model_weights.h"
#include "interception/dispatch/op_binding.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

namespace amp::detail {

struct CastDecision {
  enum class Action : uint8_t {
    kRunAsGiven,
    kCastTo,       // cast every castable argument to `to`
    kSetOptDtype,  // pass float32 through the op's `ScalarType? dtype` if the caller left it unset
    kAppendDtype,  // call the op's dtype overload with `to`
    kRefuse,       // a banned op: throw_banned
  };
  Action action = Action::kRunAsGiven;
  at::ScalarType to = at::kFloat;
};

// `Args` views one call's arguments:
//   for_each_tensor(fn): fn(const at::Tensor&, bool in_list) for each tensor
//     the arguments hold, in order, list elements included;
//   first_tensor(): the first argument if it is a tensor, else nullptr.
template <class Args>
CastDecision decide(CastPolicy policy, const DeviceCasting& casting, const Args& args);

// ---- Implementation ----

namespace decide_detail {

// Which arguments are cast, and whether backward forbids it, is settled as
// they are cast (ArgCast, cast.h): one walk.
inline CastDecision cast_to(at::ScalarType to) { return {CastDecision::Action::kCastTo, to}; }

// kLowerPrecision at O2/O3/O5: the dtype of the first weight among the
// tensor arguments (a floating leaf that requires grad), so fp32 inputs meet
// a low-precision model and modules kept fp32 compute in fp32. A master
// weight at rest (O2/O5 outside forward and backward, e.g. evaluation under
// no_grad) computes in the low dtype.
template <class Args>
at::ScalarType weights_dtype(at::ScalarType low, const DeviceCasting& c, const Args& args) {
  std::optional<at::ScalarType> found;
  args.for_each_tensor([&](const at::Tensor& t, bool in_list) {
    if (!found && !in_list && is_castable(t, c.device) && t.requires_grad() && t.is_leaf()) {
      found = t.scalar_type();
      if (*found == at::kFloat && c.weights != nullptr && c.weights->is_master(t)) found = low;
    }
  });
  return found.value_or(low);
}

// kPromote: float32 wins over the low dtype; float64 is ignored.
template <class Args>
at::ScalarType widest(at::ScalarType low, c10::DeviceType device, const Args& args) {
  at::ScalarType to = low;
  args.for_each_tensor([&](const at::Tensor& t, bool) {
    if (is_castable(t, device) && t.scalar_type() == at::kFloat) to = at::kFloat;
  });
  return to;
}

// kMatchParameters: float32 activations meeting low-precision parameters are
// cast to the parameters' dtype; a float32 parameter (a module kept fp32)
// means the call runs as given.
template <class Args>
std::optional<at::ScalarType> parameters_dtype(c10::DeviceType device, const Args& args) {
  std::optional<at::ScalarType> low;  // the first low-precision dtype seen
  bool fp32 = false, fp32_parameter = false;
  args.for_each_tensor([&](const at::Tensor& t, bool) {
    if (!is_castable(t, device)) return;
    if (t.scalar_type() == at::kFloat) {
      fp32 = true;
      fp32_parameter = fp32_parameter || (t.requires_grad() && t.is_leaf());
    } else if (!low) {
      low = t.scalar_type();
    }
  });
  return low && fp32 && !fp32_parameter ? low : std::nullopt;
}

template <class Args>
bool first_castable(c10::DeviceType device, const Args& args) {
  const at::Tensor* first = args.first_tensor();
  return first != nullptr && is_castable(*first, device);
}

}  // namespace decide_detail

// The low dtype this thread casts to on `device`: amp's, or a cast_dtype
// region's (casting_scope.h). Like native autocast, it lives in LibTorch's
// thread-local autocast state.
inline at::ScalarType thread_low_dtype(c10::DeviceType device) {
  return at::autocast::get_autocast_dtype(device);
}

template <class Args>
CastDecision decide(CastPolicy policy, const DeviceCasting& c, const Args& args) {
  using Action = CastDecision::Action;
  namespace d = decide_detail;
  switch (policy) {
    case CastPolicy::kLowerPrecision: {
      const at::ScalarType low = thread_low_dtype(c.device);
      return d::cast_to(c.weights_decide ? d::weights_dtype(low, c, args) : low);
    }
    case CastPolicy::kFp32:
      return d::cast_to(at::kFloat);
    case CastPolicy::kFp32SetOptDtype:
      if (d::first_castable(c.device, args) && !in_backward()) return {Action::kSetOptDtype};
      return {};
    case CastPolicy::kFp32AppendDtype: {
      const at::Tensor* first = args.first_tensor();
      TORCH_INTERNAL_ASSERT(first != nullptr, "kFp32AppendDtype needs a tensor first argument");
      const bool to_fp32 = is_castable(*first, c.device) && !in_backward();
      return {Action::kAppendDtype, to_fp32 ? at::kFloat : first->scalar_type()};
    }
    case CastPolicy::kPromote:
      return d::cast_to(d::widest(thread_low_dtype(c.device), c.device, args));
    case CastPolicy::kMatchParameters:
      if (const auto to = d::parameters_dtype(c.device, args)) return d::cast_to(*to);
      return {};
    case CastPolicy::kBanned:
      if (!in_backward()) return {Action::kRefuse};
      return {};
    case CastPolicy::kPassthrough:
      return {};
  }
  return {};
}

}  // namespace amp::detail
