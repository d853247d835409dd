// SPDX-License-Identifier: BSD-3-Clause
// The generic interception kernel: works on the boxed argument stack, so it
// serves any operator schema (users' own ops, e.g. "mylib::fused_norm").
// Policies are decided in cast_decision.h, as for the typed kernel; this
// file only applies the decision to the stack. Slower per call (boxing).
#include "interception/dispatch/boxed_args.h"
#include "interception/dispatch/call_record.h"
#include "interception/dispatch/cast.h"
#include "interception/dispatch/cast_decision.h"
#include "interception/dispatch/forward_watch.h"
#include "interception/dispatch/op_binding.h"
#include "interception/dispatch/typed_kernel.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>

namespace amp::detail {
namespace {

// `args`: the op's arguments, the top `num_args` entries of the stack.
// The stack's entries are replaced in place: nothing moves when none is cast.
void cast_stack(c10::IValue* args, size_t num_args, CastCheck cast) {
  for (c10::IValue* arg_it = args; arg_it != args + num_args; ++arg_it) {
    c10::IValue& arg = *arg_it;
    if (arg.isTensor()) {
      if (cast.casts(arg.toTensor())) arg = cast_uncached_or_cached(arg.toTensor(), cast.to());
    } else if (arg.isTensorList()) {
      auto list = arg.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        const at::Tensor t = list.get(i);
        if (cast.casts(t)) list.set(i, cast_uncached_or_cached(t, cast.to()));
      }
    }
  }
}

void set_float32_dtype(const c10::FunctionSchema& schema, c10::IValue* args, size_t num_args) {
  for (size_t i = 0; i < num_args; ++i) {
    if (schema.arguments()[i].name() == "dtype" && args[i].isNone()) args[i] = c10::IValue(at::kFloat);
  }
}

class BoxedKernel final : public c10::OperatorKernel {
 public:
  explicit BoxedKernel(const OpBinding* binding) : binding_(binding) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    c10::impl::ExcludeDispatchKeyGuard no_reentry(binding_->reentry_keys);
    const CastPolicy policy = binding_->policy.load(std::memory_order_relaxed);
    const size_t num_args = op.schema().arguments().size();
    const BoxedArgs view(torch::jit::last(stack, num_args));
    if (ModelWeights* weights = binding_->casting->weights; C10_UNLIKELY(weights && weights->pending())) {
      weights->on_op(view, binding_->weight_read);
    }
    if (C10_UNLIKELY(observing())) return observed_call(policy, view, op, stack, num_args);
    apply(decide(policy, *binding_->casting, view), op, stack, num_args);
  }

 private:
  // The call with op statistics and/or overflow provenance watching it.
  void observed_call(CastPolicy policy, const BoxedArgs& view, const c10::OperatorHandle& op,
                     torch::jit::Stack* stack, size_t num_args) const {
    ForwardWatch watch(binding_->casting->forward_log, binding_->display_name);
    if (watch.active()) watch.read(tensors_of(view));
    std::optional<CallRecord> record;
    if (recording()) record.emplace(*binding_, policy, describe_tensors(view));
    apply(decide(record ? record->policy() : policy, *binding_->casting, view), op, stack, num_args);
    const BoxedArgs returned(torch::jit::last(stack, op.schema().returns().size()));
    if (record) record->finish(describe_tensors(returned));
    if (watch.active()) watch.returned(tensors_of(returned));
  }

  void apply(const CastDecision& decision, const c10::OperatorHandle& op, torch::jit::Stack* stack,
             size_t num_args) const {
    using Action = CastDecision::Action;
    c10::IValue* args = stack->data() + stack->size() - num_args;
    switch (decision.action) {
      case Action::kCastTo: {
        cast_stack(args, num_args, CastCheck(decision.to, binding_->casting->device));
        break;
      }
      case Action::kSetOptDtype:
        set_float32_dtype(op.schema(), args, num_args);
        break;
      case Action::kRefuse:
        throw_banned(*binding_);
      case Action::kAppendDtype:  // check_policy_fits rejects it for boxed bindings
      case Action::kRunAsGiven:
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
