// SPDX-License-Identifier: BSD-3-Clause
#include "recompute/kept_outputs.h"

#include <amp/selective_recompute.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/enum_tag.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <mutex>
#include <set>
#include <utility>

namespace amp {

Keep::Keep(internal::KeptOps kept) : kept_(std::move(kept)) {
  (void)detail::keepable_ops(kept_.names);  // refused here, where the user names them
}

Keep Keep::nothing() { return Keep(internal::KeptOps{}); }

Keep Keep::gemm_outputs() { return Keep(internal::KeptOps{{"aten::mm", "aten::addmm", "aten::convolution"}, nullptr}); }

Keep Keep::ops(std::vector<std::string> names) {
  TORCH_CHECK(!names.empty(), "amp::Keep::ops: name at least one op (or use Keep::nothing()).");
  return Keep(internal::KeptOps{std::move(names), nullptr});
}

Keep Keep::when(std::vector<std::string> names, std::function<bool(const Call&)> keep) {
  TORCH_CHECK(!names.empty(), "amp::Keep::when: name at least one op whose calls the predicate decides on.");
  TORCH_CHECK(keep != nullptr, "amp::Keep::when: the predicate is empty; use Keep::ops to keep every call.");
  return Keep(internal::KeptOps{std::move(names), [keep = std::move(keep)](const std::string& op,
                                                                           const std::vector<at::Tensor>& inputs) {
                                  return keep(Call{op, inputs});
                                }});
}

namespace detail {
namespace {

thread_local const KeptOutputs::Scope* innermost = nullptr;

class KeepKernel final : public c10::OperatorKernel {
 public:
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    const c10::DispatchKeySet below =
        keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::ADInplaceOrView);
    const KeptOutputs::Scope* scope = innermost;
    KeptOutputs* kept = scope != nullptr ? scope->kept() : nullptr;
    if (kept == nullptr || !kept->watches(op.operator_name())) {
      op.redispatchBoxed(below, stack);
    } else if (scope->mode() == KeptOutputs::Scope::Mode::kRecord) {
      kept->record(op, below, stack);
    } else {
      kept->serve(op, below, stack);
    }
  }
};

// The ops given amp's kernel, for the process (a Keep's kernels stay).
struct Registered {
  std::mutex mutex;
  std::set<std::string> names;
  torch::Library* library = nullptr;
};
Registered& registered() {
  static Registered* r = new Registered;
  return *r;
}

bool registered_by_amp(const c10::OperatorName& op) {
  Registered& r = registered();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.names.count(c10::toString(op)) > 0;
}

void register_kernels(const std::vector<c10::OperatorName>& ops) {
  Registered& r = registered();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.library == nullptr) {
    r.library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::ADInplaceOrView, __FILE__, __LINE__);
  }
  for (const c10::OperatorName& op : ops) {
    const std::string name = c10::toString(op);
    if (!r.names.insert(name).second) continue;
    r.library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<KeepKernel>()));
  }
}

}  // namespace

std::vector<c10::OperatorName> keepable_ops(const std::vector<std::string>& names) {
  std::vector<c10::OperatorName> ops;
  for (const std::string& name : names) {
    const size_t dot = name.find('.');
    c10::OperatorName op(name.substr(0, dot), dot == std::string::npos ? "" : name.substr(dot + 1));
    const auto handle = c10::Dispatcher::singleton().findOp(op);
    TORCH_CHECK(name.rfind("aten::", 0) == 0 && handle && handle->hasSchema(), "amp::Keep: '", name,
                "' is not an ATen op; name one as \"aten::mm\", or with its overload as \"aten::add.Tensor\".");
    const c10::FunctionSchema& schema = handle->schema();
    TORCH_CHECK(!handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd), "amp::Keep: ", name,
                " is composite: it runs as other ops, whose calls the rerun meets instead (at::linear calls "
                "aten::addmm or aten::mm, at::matmul aten::mm or aten::bmm); name those.");
    bool aliases = schema.is_mutable();
    for (const c10::Argument& r : schema.returns()) aliases = aliases || r.alias_info() != nullptr;
    TORCH_CHECK(!aliases && (registered_by_amp(op) || !handle->hasKernelForDispatchKey(c10::DispatchKey::ADInplaceOrView)), "amp::Keep: ",
                name, " returns a view or changes a tensor in place; only the outputs of functional ops can be "
                "kept.");
    TORCH_CHECK(!handle->hasTag(at::Tag::nondeterministic_seeded), "amp::Keep: ", name, " draws random numbers; "
                "were its output kept, the rerun's generator would not advance past it and every later draw "
                "(dropout's masks) would differ from forward's. Keep the ops around it instead.");
    ops.push_back(std::move(op));
  }
  return ops;
}

KeptOutputs::KeptOutputs(const internal::KeptOps& keep) : when_(keep.when) {
  const std::vector<c10::OperatorName> ops = keepable_ops(keep.names);
  register_kernels(ops);
  watched_.insert(ops.begin(), ops.end());
}

KeptOutputs::Scope::Scope(KeptOutputs* kept, Mode mode) : kept_(kept), mode_(mode), previous_(innermost) {
  innermost = this;
  if (kept != nullptr && mode == Mode::kServe) kept->served_ = 0;
}

KeptOutputs::Scope::~Scope() { innermost = previous_; }

const KeptOutputs::Scope* KeptOutputs::Scope::current() { return innermost; }

void KeptOutputs::record(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack) {
  const size_t arguments = op.schema().arguments().size();
  bool keep = true;
  if (when_) {
    std::vector<at::Tensor> inputs;
    for (auto it = stack->end() - static_cast<std::ptrdiff_t>(arguments); it != stack->end(); ++it) {
      if (it->isTensor()) inputs.push_back(it->toTensor());
      if (it->isTensorList()) {
        for (const at::Tensor& t : it->toTensorVector()) inputs.push_back(t);
      }
    }
    const std::string name = c10::toString(op.operator_name());
    keep = when_(name, inputs);
  }
  op.redispatchBoxed(below, stack);
  Entry entry{op.operator_name(), keep, {}, {}};
  if (keep) {
    const size_t returns = op.schema().returns().size();
    for (auto it = stack->end() - static_cast<std::ptrdiff_t>(returns); it != stack->end(); ++it) {
      TORCH_INTERNAL_ASSERT(it->isTensor() || it->isNone(), "amp::Keep: ", c10::toString(op.operator_name()),
                            " returned something other than tensors");
      if (!it->isTensor() || !it->toTensor().defined()) {
        entry.outputs.push_back(*it);
        continue;
      }
      const at::Tensor& out = it->toTensor();
      entry.outputs.emplace_back(out.variable_data());
      entry.versions.emplace_back(out.unsafeGetTensorImpl()->version_counter(), out._version());
    }
  }
  entries_.push_back(std::move(entry));
}

void KeptOutputs::serve(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack) {
  TORCH_CHECK(served_ < entries_.size() && entries_[served_].op == op.operator_name(), "amp::recompute: when "
              "backward ran the block again it called ", c10::toString(op.operator_name()), " where forward called ",
              served_ < entries_.size() ? c10::toString(entries_[served_].op) : std::string("nothing more"),
              " (call ", served_ + 1, " among the ops its Keep names); it must compute the same thing each "
              "time it runs.");
  const Entry& entry = entries_[served_++];
  if (!entry.kept) {
    op.redispatchBoxed(below, stack);
    return;
  }
  torch::jit::drop(*stack, op.schema().arguments().size());
  for (const c10::IValue& out : entry.outputs) {
    // A tensor of its own each time: autograd attaches this run's node to it.
    stack->push_back(out.isTensor() ? c10::IValue(out.toTensor().variable_data()) : out);
  }
}

void KeptOutputs::settle() {
  for (Entry& entry : entries_) {
    bool changed = false;
    for (const auto& [counter, version] : entry.versions) changed = changed || counter.current_version() != version;
    if (changed) {  // changed in place after its op: the rerun computes it
      entry.kept = false;
      entry.outputs.clear();
      entry.versions.clear();
    }
  }
}

void KeptOutputs::check_all_served() const {
  TORCH_CHECK(served_ == entries_.size(), "amp::recompute: when backward ran the block again it made ", served_,
              " calls of the ops its Keep names, forward ", entries_.size(), "; it must compute the same thing "
              "each time it runs.");
}

int64_t KeptOutputs::kept_bytes() const {
  int64_t bytes = 0;
  for (const Entry& entry : entries_) {
    for (const c10::IValue& out : entry.outputs) {
      if (out.isTensor()) bytes += static_cast<int64_t>(out.toTensor().nbytes());
    }
  }
  return bytes;
}

}  // namespace detail
}  // namespace amp
