// Private: the unboxed interception kernel for a built-in ATen op.
//
// One instantiation per operator signature (at::_ops::<op>), registered at a
// device's Autocast key. Like LibTorch's own autocast wrappers, it excludes
// its key, casts the arguments and calls the op again from the top of the
// dispatcher, so the casts are recorded by autograd and backward runs in the
// cast dtypes. Unlike them, the policy is read at run time from its binding:
// users may change it, and one instantiation serves every policy.
#pragma once

#include "call_record.h"
#include "cast.h"
#include "op_binding.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <type_traits>

namespace amp::detail {

[[noreturn]] void throw_banned(const OpBinding& binding);

// AppendTarget: for kFp32AppendDtype, the overload taking a trailing dtype.
template <class Op, class AppendTarget = void, class Signature = typename Op::schema>
class TypedKernel;

template <class Op, class AppendTarget, class Ret, class... Args>
class TypedKernel<Op, AppendTarget, Ret(Args...)> {
 public:
  explicit TypedKernel(const OpBinding* binding) : binding_(binding) {}

  Ret operator()(Args... args) const {
    c10::impl::ExcludeDispatchKeyGuard no_reentry(binding_->casting->autocast_key);
    const CastPolicy policy = binding_->policy.load(std::memory_order_relaxed);
    if (C10_UNLIKELY(recording())) {
      // Reports show backward calls as pass-through; the check costs a call.
      const bool backward = policy != CastPolicy::kPassthrough && in_backward();
      CallRecord record(*binding_, backward ? CastPolicy::kPassthrough : policy, describe_args(args...));
      record.set_in_backward(backward);
      Ret result = apply(backward ? CastPolicy::kPassthrough : policy, args...);
      record.finish(describe_result(result));
      return result;
    }
    return apply(policy, args...);
  }

 private:
  // Backward never casts (it runs in the dtypes forward recorded). The
  // check costs a call into autograd, so it is made only where this call
  // would change its arguments.
  Ret apply(CastPolicy policy, Args... args) const {
    const DeviceCasting& c = *binding_->casting;
    switch (policy) {
      case CastPolicy::kLowerPrecision: {
        const at::ScalarType to =
            c.weights_decide ? weights_dtype(c.low_dtype, c.device, args...) : c.low_dtype;
        return call_cast(to, c.device, args...);
      }
      case CastPolicy::kFp32:
        return call_cast(at::kFloat, c.device, args...);
      case CastPolicy::kFp32SetOptDtype:
        if (first_arg_castable(c.device, args...) && !in_backward()) return Op::call(set_opt_dtype(args)...);
        return Op::call(args...);
      case CastPolicy::kFp32AppendDtype:
        if constexpr (!std::is_void_v<AppendTarget>) {
          const bool to_fp32 = first_arg_castable(c.device, args...) && !in_backward();
          return AppendTarget::call(args..., to_fp32 ? at::kFloat : first_dtype(args...));
        }
        break;  // unreachable: bindings accept kFp32AppendDtype only with a target
      case CastPolicy::kPromote:
        return call_cast(promote_type(c.low_dtype, c.device, args...), c.device, args...);
      case CastPolicy::kMatchParameters:
        if (const auto to = parameter_dtype(c.device, args...)) return call_cast(*to, c.device, args...);
        break;
      case CastPolicy::kBanned:
        if (!in_backward()) throw_banned(*binding_);
        break;
      case CastPolicy::kPassthrough:
        break;
    }
    return Op::call(args...);
  }

  static Ret call_cast(at::ScalarType to, c10::DeviceType device, Args... args) {
    if (!(needs_cast(to, device, args) || ...) || in_backward()) return Op::call(args...);
    return Op::call(cast_arg(to, device, args)...);
  }

  template <class... Rest>
  static at::ScalarType first_dtype(const at::Tensor& first, const Rest&...) {
    return first.scalar_type();
  }

  const OpBinding* binding_;
};

// Builds the kernel function the interceptor registers for a binding.
using KernelFactory = torch::CppFunction (*)(const OpBinding*);

template <class Op, class AppendTarget = void>
torch::CppFunction make_typed_kernel(const OpBinding* binding) {
  return torch::CppFunction(TypedKernel<Op, AppendTarget>(binding));
}

// Builds the generic boxed kernel (any schema), for ops without a typed one.
torch::CppFunction make_boxed_kernel(const OpBinding* binding);

}  // namespace amp::detail
