// The generic interception kernel: works on the boxed argument stack, so it
// serves any operator schema (users' own ops, e.g. "mylib::fused_norm").
// Same policy semantics as the typed kernel; slower per call (boxing).
#include "call_record.h"
#include "cast.h"
#include "op_binding.h"
#include "typed_kernel.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace amp::detail {
namespace {

template <class Fn>
void for_each_tensor(c10::IValue& arg, Fn&& fn) {
  if (arg.isTensor()) {
    fn(arg.toTensor(), [&](at::Tensor cast) { arg = std::move(cast); });
  } else if (arg.isTensorList()) {
    auto list = arg.toTensorList();
    for (size_t i = 0; i < list.size(); ++i) {
      at::Tensor t = list.get(i);
      fn(t, [&](at::Tensor cast) { list.set(i, std::move(cast)); });
    }
  }
}

std::string describe_ivalues(c10::ArrayRef<c10::IValue> values) {
  std::string out;
  for (const auto& v : values) {
    if (v.isTensor()) describe(out, v.toTensor());
    if (v.isTensorList()) describe(out, v.toTensorVector());
  }
  return out;
}

class BoxedKernel final : public c10::OperatorKernel {
 public:
  explicit BoxedKernel(const OpBinding* binding) : binding_(binding) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    c10::impl::ExcludeDispatchKeyGuard no_reentry(binding_->casting->autocast_key);
    CastPolicy policy = binding_->policy.load(std::memory_order_relaxed);
    // Boxed calls are slow anyway: decide backward up front.
    const bool backward = policy != CastPolicy::kPassthrough && in_backward();
    if (backward) policy = CastPolicy::kPassthrough;
    const size_t num_args = op.schema().arguments().size();
    if (C10_UNLIKELY(recording())) {
      CallRecord record(*binding_, policy, describe_ivalues(torch::jit::last(stack, num_args)));
      record.set_in_backward(backward);
      apply(policy, op, stack, num_args);
      record.finish(describe_ivalues(torch::jit::last(stack, op.schema().returns().size())));
      return;
    }
    apply(policy, op, stack, num_args);
  }

 private:
  void apply(CastPolicy policy, const c10::OperatorHandle& op, torch::jit::Stack* stack,
             size_t num_args) const {
    const DeviceCasting& c = *binding_->casting;
    const auto first = stack->end() - static_cast<std::ptrdiff_t>(num_args);
    auto cast_all = [&](at::ScalarType to) {
      for (auto it = first; it != stack->end(); ++it) {
        for_each_tensor(*it, [&](const at::Tensor& t, auto replace) {
          if (is_castable(t, c.device) && t.scalar_type() != to) {
            replace(cast_uncached_or_cached(t, to));
          }
        });
      }
    };
    switch (policy) {
      case CastPolicy::kLowerPrecision: {
        at::ScalarType to = c.low_dtype;
        if (c.weights_decide) {
          for (auto it = first; it != stack->end(); ++it) {
            if (!it->isTensor()) continue;
            if (auto weight = weight_dtype_of(c.device, it->toTensor())) {
              to = *weight;
              break;
            }
          }
        }
        cast_all(to);
        break;
      }
      case CastPolicy::kFp32:
        cast_all(at::kFloat);
        break;
      case CastPolicy::kFp32SetOptDtype: {
        if (num_args == 0 || !first->isTensor() || !is_castable(first->toTensor(), c.device)) break;
        const auto& schema_args = op.schema().arguments();
        for (size_t i = 0; i < num_args; ++i) {
          if (schema_args[i].name() == "dtype" && (first + i)->isNone()) {
            *(first + i) = c10::IValue(at::kFloat);
          }
        }
        break;
      }
      case CastPolicy::kPromote: {
        at::ScalarType to = c.low_dtype;
        for (auto it = first; it != stack->end(); ++it) {
          for_each_tensor(*it, [&](const at::Tensor& t, auto) { to = widen(to, c.device, t); });
        }
        cast_all(to);
        break;
      }
      case CastPolicy::kMatchParameters: {
        ParameterMix mix;
        for (auto it = first; it != stack->end(); ++it) {
          for_each_tensor(*it, [&](const at::Tensor& t, auto) { mix.see(c.device, t); });
        }
        if (const auto to = mix.target()) cast_all(*to);
        break;
      }
      case CastPolicy::kBanned:
        throw_banned(*binding_);
      case CastPolicy::kFp32AppendDtype:  // rejected for boxed bindings
      case CastPolicy::kPassthrough:
        break;
    }
    op.callBoxed(stack);
  }

  const OpBinding* binding_;
};

}  // namespace

torch::CppFunction make_boxed_kernel(const OpBinding* binding) {
  return torch::CppFunction::makeFromBoxedFunctor(std::make_unique<BoxedKernel>(binding));
}

}  // namespace amp::detail
