// SPDX-License-Identifier: BSD-3-Clause
// Private: the unboxed interception kernel for a built-in ATen op.
//
// One instantiation per operator signature (at::_ops::<op>), registered at a
// device's Autocast key. Like LibTorch's own autocast wrappers, it excludes
// its key, casts the arguments and calls the op again from the top of the
// dispatcher, so the casts are recorded by autograd and backward runs in the
// cast dtypes. Unlike them, the policy is read at run time from its binding:
// users may change it, and one instantiation serves every policy. What each
// policy does is decided in cast_decision.h, shared with the boxed kernel.
#pragma once

#include "interception/dispatch/call_record.h"
#include "interception/dispatch/cast.h"
#include "interception/dispatch/cast_decision.h"
#include "interception/dispatch/forward_watch.h"
#include "interception/dispatch/fp8_call.h"
#include "interception/dispatch/op_binding.h"
#include "interception/measured_policy.h"

#include <ATen/ops/_cudnn_rnn_ops.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <type_traits>

namespace amp::detail {

[[noreturn]] void throw_banned(const OpBinding& binding);

// The typed arguments of one call, as cast_decision.h views them.
template <class... Args>
class TypedArgs {
 public:
  explicit TypedArgs(const Args&... args) : args_(args...) {}

  template <class Fn>
  void for_each_tensor(Fn&& fn) const {
    std::apply([&](const auto&... arg) { (visit_tensors(arg, fn), ...); }, args_);
  }
  const at::Tensor* first_tensor() const {
    if constexpr (sizeof...(Args) > 0) {
      using First = std::decay_t<std::tuple_element_t<0, std::tuple<Args...>>>;
      if constexpr (std::is_same_v<First, at::Tensor>) return &std::get<0>(args_);
    }
    return nullptr;
  }

 private:
  std::tuple<const Args&...> args_;
};

// How a kCastTo decision calls `Op`: every castable argument cast to `to`.
// An op that needs more specializes it here.
template <class Op>
struct CastCall {
  template <class... Args>
  static auto call(at::ScalarType to, c10::DeviceType device, const Args&... args) {
    ArgCastFor<Args...> cast(to, device);
    return Op::call(cast(args)...);
  }
};
// cuDNN RNNs: the weights cast one by one, not through cuDNN's packed buffer
// (cudnn_rnn_cast.cpp).
template <>
struct CastCall<at::_ops::_cudnn_rnn> {
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> call(
      at::ScalarType to, c10::DeviceType device, const at::Tensor& input, at::TensorList weight,
      int64_t weight_stride0, const std::optional<at::Tensor>& weight_buf, const at::Tensor& hx,
      const std::optional<at::Tensor>& cx, int64_t mode, const c10::SymInt& hidden_size,
      const c10::SymInt& proj_size, int64_t num_layers, bool batch_first, double dropout, bool train,
      bool bidirectional, c10::SymIntArrayRef batch_sizes, const std::optional<at::Tensor>& dropout_state);
};

// The measured policy's timing runs (measured_policy.h): the argument as a
// leaf of its own graph, requiring a gradient where it does, so a timed run
// can backpropagate without touching the program's graph.
inline at::Tensor as_timing_leaf(const at::Tensor& t) {
  return t.defined() && t.requires_grad() ? t.detach().requires_grad_(true) : t;
}
inline std::optional<at::Tensor> as_timing_leaf(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return t;
  return as_timing_leaf(*t);
}
template <class T>
const T& as_timing_leaf(const T& arg) {
  return arg;
}

// AppendTarget: for kFp32AppendDtype, the overload taking a trailing dtype.
template <class Op, class AppendTarget = void, class Signature = typename Op::schema>
class TypedKernel;

template <class Op, class AppendTarget, class Ret, class... Args>
class TypedKernel<Op, AppendTarget, Ret(Args...)> {
 public:
  explicit TypedKernel(const OpBinding* binding) : binding_(binding) {}

  Ret operator()(Args... args) const {
    c10::impl::ExcludeDispatchKeyGuard no_reentry(binding_->reentry_keys);
    const CastPolicy policy = binding_->policy.load(std::memory_order_relaxed);
    const TypedArgs<Args...> view(args...);
    if (ModelWeights* weights = binding_->casting->weights; C10_UNLIKELY(weights && weights->pending())) {
      weights->on_op(view, binding_->weight_read);
    }
    if (C10_UNLIKELY(observing())) return observed_call(policy, view, args...);
    return apply(decide(policy, *binding_->casting, view), args...);
  }

 private:
  // The call with op statistics and/or overflow provenance watching it.
  Ret observed_call(CastPolicy policy, const TypedArgs<Args...>& view, Args... args) const {
    ForwardWatch watch(binding_->casting->forward_log, binding_->display_name);
    if (watch.active()) watch.read(tensors_of(view));
    std::optional<CallRecord> record;
    if (recording()) record.emplace(*binding_, policy, describe_tensors(view));
    CastDecision decision = decide(record ? record->policy() : policy, *binding_->casting, view);
    if (measuring() && binding_->measured && decision.action == CastDecision::Action::kCastTo &&
        decision.to != at::kFloat && view.first_tensor() != nullptr && !in_backward()) {
      decision.to = measured_dtype(binding_->display_name, view.first_tensor()->device(), shape_key(view), decision.to,
                                   [&] { return describe_shapes(view); }, [&](at::ScalarType to) { timing_run(to, args...); },
                                   binding_->casting->measured_timer);
    }
    Ret result = apply(decision, args...);
    if (record) record->finish(describe_result(result));
    if (watch.active()) watch.returned(result_tensors(result));
    return result;
  }

  // One timed run of the op in `to`: forward, and backward where an
  // argument requires a gradient (what training pays for the choice).
  void timing_run(at::ScalarType to, Args... args) const {
    at::AutoGradMode grad(true);
    Ret out = CastCall<Op>::call(to, binding_->casting->device, as_timing_leaf(args)...);
    if constexpr (std::is_same_v<Ret, at::Tensor>) {
      if (out.requires_grad()) out.backward(at::ones_like(out));
    }
  }

  Ret apply(const CastDecision& decision, Args... args) const {
    using Action = CastDecision::Action;
    switch (decision.action) {
      case Action::kCastTo:
        if constexpr (Fp8Call<Op>::kApplies) {  // the fp8 property
          if (Fp8Gemms* fp8 = binding_->casting->fp8; fp8 != nullptr && decision.to == at::kBFloat16) {
            if (auto out = Fp8Call<Op>::call(*fp8, decision.to, binding_->casting->device, args...)) return *out;
          }
        }
        return CastCall<Op>::call(decision.to, binding_->casting->device, args...);
      case Action::kSetOptDtype:
        return Op::call(set_opt_dtype(args)...);
      case Action::kAppendDtype:
        if constexpr (!std::is_void_v<AppendTarget>) return AppendTarget::call(args..., decision.to);
        break;  // unreachable: bindings accept kFp32AppendDtype only with a target
      case Action::kRefuse:
        throw_banned(*binding_);
      case Action::kRunAsGiven:
        break;
    }
    return Op::call(args...);
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
