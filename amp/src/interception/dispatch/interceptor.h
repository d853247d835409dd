// SPDX-License-Identifier: BSD-3-Clause
// Private: the dispatcher registrations of one live amp context.
//
// Constructing an Interceptor registers amp's kernel for every op of the
// effective policy tables at AutocastCPU and AutocastCUDA, through run-time
// torch::Library objects (replacing LibTorch's native autocast kernels for
// those ops). Destroying it drops the libraries, which unregisters every amp
// kernel and brings the native ones back: native at::autocast works again.
// Kernels run only on threads whose autocast keys are enabled (see
// casting_scope.h). It also registers aten::set_, torch::load's way into a
// model, so that checkpoints of other dtypes load converted.
#pragma once

#include "interception/dispatch/op_binding.h"
#include "interception/dispatch/typed_kernel.h"
#include "interception/policy_registry.h"

#include <torch/library.h>

#include <map>
#include <string>
#include <string_view>
#include <memory>
#include <vector>

namespace amp::detail {

class Interceptor {
 public:
  // One DeviceCasting per device amp intercepts (CPU and CUDA); binds the
  // tables and the user's registrations, read under `held`.
  Interceptor(const std::vector<DeviceCasting>& devices, const RegistrationLock& held);
  ~Interceptor();
  Interceptor(const Interceptor&) = delete;
  Interceptor& operator=(const Interceptor&) = delete;

  // Applies a user registration made while this interceptor lives.
  void set_policy(const c10::OperatorName& op, c10::DeviceType device, CastPolicy policy);

  const DeviceCasting* casting(c10::DeviceType device) const;

 private:
  void bind(const c10::OperatorName& op, DeviceCasting& casting, CastPolicy policy,
            KernelFactory make_kernel, const char* banned_because = nullptr);
  torch::Library& library_for(const std::string& ns, c10::DispatchKey key);

  std::vector<std::unique_ptr<DeviceCasting>> devices_;
  std::map<std::pair<std::string, c10::DeviceType>, std::unique_ptr<OpBinding>> bindings_;
  // Declared last so it is destroyed first: no kernel outlives its binding.
  std::map<std::pair<std::string, c10::DispatchKey>, std::unique_ptr<torch::Library>> libraries_;
};

// The typed kernel for a built-in op found in either default table, or the
// boxed kernel for any other op.
KernelFactory kernel_factory_for(const c10::OperatorName& op);

// "ns::name" or "ns::name.overload", checked to exist in the dispatcher.
c10::OperatorName parse_op_name(std::string_view op);
// Throws when `policy` cannot apply to `op`'s schema.
void check_policy_fits(const c10::OperatorName& op, CastPolicy policy);
std::string to_string(const c10::OperatorName& op);

}  // namespace amp::detail

