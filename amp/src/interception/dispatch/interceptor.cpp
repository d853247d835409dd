// SPDX-License-Identifier: BSD-3-Clause
#include "interception/dispatch/interceptor.h"

#include "interception/dispatch/forward_watch.h"
#include "interception/dispatch/weight_reads.h"
#include "interception/measured_policy.h"

#include "model/model_weights.h"

#include "interception/policy_tables/table_entry.h"
#include "interception/policy_registry.h"

#include <ATen/Operators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <unordered_map>

namespace amp::detail {
namespace {

// LibTorch warns once per process when a kernel replaces another at the same
// key. amp replaces native autocast kernels on purpose, so that one warning
// is dropped; any other warning reaches the previous handler.
class DropOverrideWarning final : public c10::WarningHandler {
 public:
  explicit DropOverrideWarning(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") != std::string::npos) {
      return;
    }
    next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

// torch::load's way into a model: LibTorch's InputArchive gives each
// parameter and buffer the tensor it read with `set_`, which keeps the
// target's dtype and reinterprets the source's bytes (a float32 checkpoint
// read into a float16 model becomes garbage; a float16 one into a float32
// model fails). While amp is live a floating tensor takes the source's
// values converted to its dtype instead; the weights amp lowered go through
// ModelWeights (model_weights.h), which keeps their masters. Every other
// call runs as LibTorch's.
class WeightLoadKernel {
 public:
  explicit WeightLoadKernel(const DeviceCasting* casting) : casting_(casting) {}
  at::Tensor& operator()(at::Tensor& self, const at::Tensor& source) const {
    c10::impl::ExcludeDispatchKeyGuard no_reentry(c10::DispatchKeySet(casting_->autocast_key));
    if (casting_->weights != nullptr && casting_->weights->load_into(self, source)) return self;
    const bool converts = self.is_floating_point() && source.is_floating_point() &&
                          self.scalar_type() != source.scalar_type() && self.device() == source.device();
    return at::_ops::set__source_Tensor::call(self, converts ? source.to(self.scalar_type()) : source);
  }

 private:
  const DeviceCasting* casting_;
};

bool has_optional_dtype_argument(const c10::FunctionSchema& schema) {
  for (const auto& arg : schema.arguments()) {
    if (arg.name() == "dtype" && arg.type()->kind() == c10::TypeKind::OptionalType) return true;
  }
  return false;
}

}  // namespace

std::string to_string(const c10::OperatorName& op) {
  return op.overload_name.empty() ? op.name : op.name + "." + op.overload_name;
}

c10::OperatorName parse_op_name(std::string_view op) {
  const size_t ns_end = op.find("::");
  TORCH_CHECK(ns_end != std::string_view::npos && ns_end > 0 && ns_end + 2 < op.size(),
              "amp: expected an operator name 'namespace::name' or "
              "'namespace::name.overload' (e.g. 'aten::softmax.int', 'mylib::fused_norm'), got '",
              op, "'");
  const size_t dot = op.find('.', ns_end + 2);
  c10::OperatorName name(std::string(op.substr(0, dot)),
                         dot == std::string_view::npos ? "" : std::string(op.substr(dot + 1)));
  auto handle = c10::Dispatcher::singleton().findOp(name);
  TORCH_CHECK(handle.has_value() && handle->hasSchema(), "amp: no operator '", op,
              "' is registered with the LibTorch dispatcher. Check the spelling and overload "
              "(a name without '.overload' means the default overload), and load the library "
              "that defines it (TORCH_LIBRARY) before registering it with amp.");
  return name;
}

void check_policy_fits(const c10::OperatorName& op, CastPolicy policy) {
  TORCH_CHECK(policy != CastPolicy::kFp32AppendDtype, "amp: kFp32AppendDtype is reserved for "
              "the built-in table rows that redirect to a dtype overload; register '",
              to_string(op), "' as kFp32 instead.");
  if (policy == CastPolicy::kFp32SetOptDtype) {
    const auto& schema = c10::Dispatcher::singleton().findOp(op)->schema();
    TORCH_CHECK(has_optional_dtype_argument(schema), "amp: kFp32SetOptDtype needs an op with a "
                "'ScalarType? dtype' argument; '", to_string(op), "' has schema ", schema,
                ". Register it as kFp32 instead.");
  }
}

// The reason a built-in table row gives for banning `op`, on any device; a
// user who bans a built-in op on another device gets the same advice.
const char* built_in_banned_reason(const c10::OperatorName& op) {
  for (const auto* table : {&cpu_policy_table(), &cuda_policy_table()}) {
    for (const TableEntry& e : *table) {
      if (e.banned_because != nullptr && c10::OperatorName(e.name, e.overload) == op) return e.banned_because;
    }
  }
  return nullptr;
}

KernelFactory kernel_factory_for(const c10::OperatorName& op) {
  static const auto catalog = [] {
    std::unordered_map<c10::OperatorName, KernelFactory> factories;
    for (const auto* table : {&cpu_policy_table(), &cuda_policy_table(), &model_policy_table()}) {
      for (const TableEntry& e : *table) {
        if (e.policy == CastPolicy::kFp32AppendDtype) continue;  // redirecting kernels
        factories.emplace(c10::OperatorName(e.name, e.overload), e.make_kernel);
      }
    }
    return factories;
  }();
  auto it = catalog.find(op);
  return it != catalog.end() ? it->second : &make_boxed_kernel;
}

Interceptor::Interceptor(const std::vector<DeviceCasting>& devices, const RegistrationLock& held) {
  static const std::vector<TableEntry> no_entries;
  DropOverrideWarning filter(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard guard(&filter);
  for (const DeviceCasting& device : devices) {
    devices_.push_back(std::make_unique<DeviceCasting>(device));
    DeviceCasting& casting = *devices_.back();
    const auto& table = casting.device == c10::DeviceType::CUDA ? cuda_policy_table()
                                                                : cpu_policy_table();
    for (const TableEntry& e : table) {
      const bool runs_here = !e.needs_onednn_low_precision || casting.onednn_low_precision;
      bind(c10::OperatorName(e.name, e.overload), casting, runs_here ? e.policy : CastPolicy::kFp32,
           e.make_kernel, e.banned_because);
    }
    for (const TableEntry& e : casting.weights_decide ? model_policy_table() : no_entries) {
      const c10::OperatorName op(e.name, e.overload);
      if (!bindings_.count({to_string(op), casting.device})) bind(op, casting, e.policy, e.make_kernel);
    }
    for (const auto& [op, policy] : user_registrations(held, casting.device)) {
      bind(op, casting, policy, kernel_factory_for(op), built_in_banned_reason(op));
    }
    library_for("aten", casting.autocast_key)
        .impl("set_.source_Tensor", torch::CppFunction(WeightLoadKernel(&casting)));
    if (casting.forward_log != nullptr) watch_other_ops(library_for("aten", casting.autocast_key), casting);
    if (casting.weights != nullptr) {
      watch_weight_reads(library_for("aten", casting.autocast_key), casting, [&](const c10::OperatorName& op) {
        return c10::Dispatcher::singleton().findOp(op)->hasKernelForDispatchKey(casting.autocast_key);
      });
    }
  }
}

torch::Library& Interceptor::library_for(const std::string& ns, c10::DispatchKey key) {
  auto& library = libraries_[{ns, key}];
  if (!library) library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, __LINE__);
  return *library;
}

Interceptor::~Interceptor() {
  DropOverrideWarning filter(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard guard(&filter);
  libraries_.clear();
}

const DeviceCasting* Interceptor::casting(c10::DeviceType device) const {
  for (const auto& d : devices_) {
    if (d->device == device) return d.get();
  }
  return nullptr;
}

void Interceptor::set_policy(const c10::OperatorName& op, c10::DeviceType device,
                             CastPolicy policy) {
  DropOverrideWarning filter(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard guard(&filter);
  for (auto& d : devices_) {
    if (d->device == device) bind(op, *d, policy, kernel_factory_for(op), built_in_banned_reason(op));
  }
}

void Interceptor::bind(const c10::OperatorName& op, DeviceCasting& casting, CastPolicy policy,
                       KernelFactory make_kernel, const char* banned_because) {
  const std::string display = to_string(op);
  auto it = bindings_.find({display, casting.device});
  if (it != bindings_.end()) {  // already intercepted: its kernel reads the new policy
    if (banned_because != nullptr) it->second->banned_because.store(banned_because);
    it->second->set_policy(policy);
    return;
  }
  auto binding = std::make_unique<OpBinding>();
  binding->display_name = display;
  binding->measured = is_measured_op(display);
  binding->casting = &casting;
  binding->reentry_keys = c10::DispatchKeySet(casting.autocast_key);
  binding->banned_because.store(banned_because);
  binding->weight_read = is_weight_read(op);
  binding->set_policy(policy);
  library_for(op.name.substr(0, op.name.find("::")), casting.autocast_key)
      .impl(display.c_str(), make_kernel(binding.get()));
  bindings_.emplace(std::make_pair(display, casting.device), std::move(binding));
}

void OpBinding::set_policy(CastPolicy table) {
  CastPolicy applied = table;
  const bool fp32_family = table == CastPolicy::kFp32 || table == CastPolicy::kFp32SetOptDtype ||
                           table == CastPolicy::kFp32AppendDtype || table == CastPolicy::kBanned;
  if (table == CastPolicy::kBanned && casting->allow_banned) applied = CastPolicy::kFp32;
  if (fp32_family && !casting->fp32_ops) applied = CastPolicy::kPassthrough;
  policy.store(applied, std::memory_order_relaxed);
}

}  // namespace amp::detail
