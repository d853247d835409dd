// SPDX-License-Identifier: BSD-3-Clause
// Private: the unboxed interception kernel for a built-in ATen op.
//
// One instantiation per operator signature, shared by the ops of that
// signature (it calls its op through a pointer), registered at a device's
// Autocast key; an op with a call of its own (kOwnKernel) has its own. Like
// LibTorch's own autocast wrappers, it excludes its key, casts the arguments
// and calls the op again from the top of the dispatcher, so the casts are
// recorded by autograd and backward runs in the cast dtypes. Unlike them,
// the policy is read at run time from its binding: users may change it, and
// one instantiation serves every policy. What each policy does is decided in
// cast_decision.h, shared with the boxed kernel.
#pragma once

#include "interception/dispatch/call_record.h"
#include "interception/dispatch/cast.h"
#include "interception/dispatch/cast_decision.h"
#include "interception/dispatch/forward_watch.h"
#include "interception/dispatch/fp8_call.h"
#include "interception/dispatch/observed_call.h"
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

// How a kCastTo decision calls `op` (Op::call): every castable argument
// cast to `to`. An op that needs more specializes it here (and kOwnKernel).
template <class Op>
struct CastCall {
  template <class Call, class... Args>
  static auto call(Call* op, at::ScalarType to, c10::DeviceType device, const Args&... args) {
    ArgCastFor<Args...> cast(to, device);
    return op(cast(args)...);
  }
};
// cuDNN RNNs: the weights cast one by one, not through cuDNN's packed buffer
// (cudnn_rnn_cast.cpp).
template <>
struct CastCall<at::_ops::_cudnn_rnn> {
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> call(
      at::_ops::_cudnn_rnn::schema* op, at::ScalarType to, c10::DeviceType device, const at::Tensor& input,
      at::TensorList weight, int64_t weight_stride0, const std::optional<at::Tensor>& weight_buf, const at::Tensor& hx,
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

// Whether `Op` needs a kernel of its own: its casts or float8 call are its
// own, or it appends a dtype (AppendTarget: the overload taking a trailing
// dtype, for kFp32AppendDtype). The others share their signature's, which
// compiles each signature's kernel once (the tables' build time) and costs
// a call through a pointer.
template <class Op, class AppendTarget>
inline constexpr bool kOwnKernel = Fp8Call<Op>::kApplies || std::is_same_v<Op, at::_ops::_cudnn_rnn> ||
                                   !std::is_void_v<AppendTarget>;

// Op: the op whose kernel this is, or void for any op of `Signature`.
template <class Op, class AppendTarget, class Signature>
class TypedKernel;

template <class Op, class AppendTarget, class Ret, class... Args>
class TypedKernel<Op, AppendTarget, Ret(Args...)> {
 public:
  // `op`: the op's entry at the top of the dispatcher (at::_ops::<op>::call).
  TypedKernel(const OpBinding* binding, Ret (*op)(Args...)) : binding_(binding), op_(op) {}

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
    const GatheredTensors tensors(view);
    ForwardWatch watch(binding_->casting->forward_log, binding_->display_name);
    if (watch.active()) watch.read(tensors_of(tensors));
    std::optional<CallRecord> record;
    if (recording()) record.emplace(*binding_, policy, describe_tensors(tensors));
    CastDecision decision = decide(record ? record->policy() : policy, *binding_->casting, view);
    if (measuring() && binding_->measured && decision.action == CastDecision::Action::kCastTo &&
        decision.to != at::kFloat && view.first_tensor() != nullptr && !in_backward()) {
      decision.to = measured_call_dtype(*binding_, tensors, view.first_tensor()->device(), decision.to,
                                        [&](at::ScalarType to) { timing_run(to, args...); });
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
    Ret out = CastCall<Op>::call(op_, to, binding_->casting->device, as_timing_leaf(args)...);
    if constexpr (std::is_same_v<Ret, at::Tensor>) backpropagate_ones(out);
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
        return CastCall<Op>::call(op_, decision.to, binding_->casting->device, args...);
      case Action::kSetOptDtype:
        return op_(set_opt_dtype(args)...);
      case Action::kAppendDtype:
        if constexpr (!std::is_void_v<AppendTarget>) return AppendTarget::call(args..., decision.to);
        break;  // unreachable: bindings accept kFp32AppendDtype only with a target
      case Action::kRefuse:
        throw_banned(*binding_);
      case Action::kRunAsGiven:
        break;
    }
    return op_(args...);
  }

  const OpBinding* binding_;
  Ret (*op_)(Args...);
};

// Builds the kernel function the interceptor registers for a binding.
using KernelFactory = torch::CppFunction (*)(const OpBinding*);

template <class Op, class AppendTarget = void>
torch::CppFunction make_typed_kernel(const OpBinding* binding) {
  using KernelOp = std::conditional_t<kOwnKernel<Op, AppendTarget>, Op, void>;
  return torch::CppFunction(TypedKernel<KernelOp, AppendTarget, typename Op::schema>(binding, &Op::call));
}

// Builds the generic boxed kernel (any schema), for ops without a typed one.
torch::CppFunction make_boxed_kernel(const OpBinding* binding);

}  // namespace amp::detail
