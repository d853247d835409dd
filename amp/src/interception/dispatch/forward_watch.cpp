// SPDX-License-Identifier: BSD-3-Clause
#include "interception/dispatch/forward_watch.h"

#include "interception/dispatch/boxed_args.h"
#include "interception/dispatch/interceptor.h"
#include "interception/dispatch/op_binding.h"
#include "interception/dispatch/weight_reads.h"
#include "model/model_weights.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cmath>
#include <string_view>

namespace amp::detail {

std::vector<at::Tensor> amax_each(at::TensorList tensors) {
  std::vector<at::Tensor> checked;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || t.numel() == 0 || !(t.is_floating_point() || t.is_complex())) continue;
    if (t.is_sparse()) {
      checked.push_back(t._values());
    } else if (t.layout() == c10::kStrided && !t.is_meta()) {
      checked.push_back(t);
    }
  }
  if (checked.empty()) return {};
  at::NoGradGuard no_grad;
  return at::_foreach_norm(checked, INFINITY);
}

namespace {

bool holds_tensors(const c10::TypePtr& type) {
  switch (type->kind()) {
    case c10::TypeKind::TensorType:
      return true;
    case c10::TypeKind::OptionalType:
    case c10::TypeKind::ListType:
      return type->containedType(0)->kind() == c10::TypeKind::TensorType;
    default:
      return false;
  }
}

// Ops whose outputs start uninitialized: their values mean nothing.
bool returns_uninitialized(std::string_view name) {
  return name.find("empty") != std::string_view::npos || name.find("resize") != std::string_view::npos ||
         name == "aten::set_";
}

// Worth watching: reads a tensor and returns new values - not only views
// of its inputs, whose values it did not make.
bool makes_values(const c10::FunctionSchema& schema) {
  bool reads_tensor = false;
  for (const auto& arg : schema.arguments()) reads_tensor = reads_tensor || holds_tensors(arg.type());
  bool returns_values = false;
  for (const auto& ret : schema.returns()) {
    const bool aliases_only = ret.alias_info() != nullptr && !ret.alias_info()->isWrite();
    returns_values = returns_values || (holds_tensors(ret.type()) && !aliases_only);
  }
  return reads_tensor && returns_values;
}

void append_tensors(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) out.push_back(t);
  }
}

// Watches an aten op amp does not intercept: records around the call,
// changes nothing in it (an indexed read of a weight lowers its model
// first, as weight_reads.h does without provenance).
class WatchKernel final : public c10::OperatorKernel {
 public:
  WatchKernel(const c10::OperatorName& op, const c10::FunctionSchema& schema, const DeviceCasting& casting)
      : name_(to_string(op)),
        reentry_keys_(casting.autocast_key),
        log_(casting.forward_log),
        weights_(casting.weights),
        weight_read_(is_weight_read(op)) {
    for (const auto& arg : schema.arguments()) {
      // out= arguments are written, not read: their old contents mean nothing.
      const bool out = arg.kwarg_only() && arg.alias_info() != nullptr && arg.alias_info()->isWrite();
      reads_.push_back(!out);
    }
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    c10::impl::ExcludeDispatchKeyGuard no_reentry(reentry_keys_);
    if (weights_ != nullptr && weights_->pending()) {
      weights_->on_op(BoxedArgs(torch::jit::last(stack, reads_.size())), weight_read_);
    }
    ForwardWatch watch(log_, name_);
    if (!watch.active()) return op.callBoxed(stack);
    const c10::IValue* args = stack->data() + stack->size() - reads_.size();
    std::vector<at::Tensor> read;
    for (size_t i = 0; i < reads_.size(); ++i) {
      if (reads_[i]) append_tensors(args[i], read);
    }
    watch.read(read);
    op.callBoxed(stack);
    std::vector<at::Tensor> returned;
    for (const c10::IValue& v : torch::jit::last(stack, op.schema().returns().size())) append_tensors(v, returned);
    watch.returned(returned);
  }

 private:
  std::string name_;
  c10::DispatchKeySet reentry_keys_;
  ForwardLog* log_;
  ModelWeights* weights_;
  bool weight_read_;
  std::vector<bool> reads_;  // per argument: read (true) or an out= argument
};

}  // namespace

void ForwardLog::add(ForwardRecord record) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (records_.size() == kCapacity) records_.pop_front();
  records_.push_back(std::move(record));
}

std::vector<ForwardRecord> ForwardLog::claim(const std::function<bool(const torch::autograd::Node*)>& in_graph) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<ForwardRecord> claimed;
  std::deque<ForwardRecord> kept;
  for (ForwardRecord& r : records_) {
    if (!r.has_node) {
      claimed.push_back(std::move(r));
      continue;
    }
    const std::shared_ptr<torch::autograd::Node> node = r.node.lock();
    if (!node) continue;  // its graph is gone: no guard will claim it
    if (in_graph(node.get())) {
      claimed.push_back(std::move(r));
    } else {
      kept.push_back(std::move(r));
    }
  }
  records_ = std::move(kept);
  return claimed;
}

void ForwardLog::edit(const std::function<void(ForwardRecord&)>& edit) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (ForwardRecord& r : records_) edit(r);
}

void ForwardLog::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  records_.clear();
}

ForwardWatch::ForwardWatch(ForwardLog* log, const std::string& op)
    : log_(log != nullptr && c10::GradMode::is_enabled() &&
                   torch::autograd::get_current_graph_task_id() == -1
               ? log
               : nullptr) {
  record_.op = &op;
}

void ForwardWatch::read(const std::vector<at::Tensor>& tensors) { record_.read_amax = amax_each(tensors); }

void ForwardWatch::returned(const std::vector<at::Tensor>& tensors) {
  record_.returned_amax = amax_each(tensors);
  if (record_.returned_amax.empty()) return;  // nothing it returned can hold inf/NaN
  for (const at::Tensor& t : tensors) {
    if (t.defined() && (t.is_floating_point() || t.is_complex())) {
      record_.dtype = t.scalar_type();
      if (const auto& grad_fn = t.grad_fn()) {
        record_.node = grad_fn;
        record_.has_node = true;
      }
      break;
    }
  }
  log_->add(std::move(record_));
}

void watch_other_ops(torch::Library& library, const DeviceCasting& casting) {
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0 || returns_uninitialized(name.name)) continue;
    const auto handle = dispatcher.findOp(name);
    if (!handle || !handle->hasSchema() || handle->hasKernelForDispatchKey(casting.autocast_key)) continue;
    if (!makes_values(handle->schema())) continue;
    const std::string display = to_string(name);
    library.impl(display.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                      std::make_unique<WatchKernel>(name, handle->schema(), casting)));
  }
}

}  // namespace amp::detail
