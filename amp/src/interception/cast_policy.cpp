// SPDX-License-Identifier: BSD-3-Clause
// The public face of the policy tables: reading them and user registrations.
#include <amp/cast_policy.h>

#include "interception/casting_session.h"
#include "interception/dispatch/interceptor.h"
#include "interception/policy_registry.h"
#include "interception/policy_tables/table_entry.h"

#include <algorithm>
#include <map>
#include <mutex>

namespace amp {
namespace detail {
namespace {

// Guarded by RegistrationLock.
struct Registry {
  std::mutex mutex;
  // (op display name, device) -> (op, policy); a later registration replaces.
  std::map<std::pair<std::string, c10::DeviceType>, std::pair<c10::OperatorName, CastPolicy>> user;
  std::vector<std::pair<std::string, c10::DeviceType>> order;
};

Registry& registry() {
  static Registry* r = new Registry();  // leaked: used during static destruction
  return *r;
}

const std::vector<TableEntry>& default_table(c10::DeviceType device) {
  TORCH_CHECK(device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA,
              "amp: cast policies exist for CPU and CUDA, got device ", device);
  return device == c10::DeviceType::CUDA ? cuda_policy_table() : cpu_policy_table();
}

}  // namespace

RegistrationLock::RegistrationLock() : lock_(registry().mutex) {}

std::vector<std::pair<c10::OperatorName, CastPolicy>> user_registrations(const RegistrationLock&,
                                                                         c10::DeviceType device) {
  const Registry& r = registry();
  std::vector<std::pair<c10::OperatorName, CastPolicy>> out;
  for (const auto& key : r.order) {
    if (key.second == device) out.push_back(r.user.at(key));
  }
  return out;
}

}  // namespace detail

const char* to_string(CastPolicy policy) {
  switch (policy) {
    case CastPolicy::kLowerPrecision: return "lower_precision";
    case CastPolicy::kFp32: return "fp32";
    case CastPolicy::kFp32SetOptDtype: return "fp32_set_opt_dtype";
    case CastPolicy::kFp32AppendDtype: return "fp32_append_dtype";
    case CastPolicy::kPromote: return "promote";
    case CastPolicy::kBanned: return "banned";
    case CastPolicy::kPassthrough: return "passthrough";
    case CastPolicy::kMatchParameters: return "match_parameters";
  }
  return "?";
}

std::vector<OpPolicy> policy_table(c10::DeviceType device) {
  std::map<std::string, CastPolicy> merged;
  for (const auto& e : detail::default_table(device)) {
    merged[detail::to_string(c10::OperatorName(e.name, e.overload))] = e.policy;
  }
  const detail::RegistrationLock held;
  for (const auto& [op, policy] : detail::user_registrations(held, device)) {
    merged[detail::to_string(op)] = policy;
  }
  std::vector<OpPolicy> out;
  for (const auto& [op, policy] : merged) out.push_back({op, policy});
  return out;
}

std::vector<OpPolicy> model_policy_table() {
  std::vector<OpPolicy> out;
  for (const auto& e : detail::model_policy_table()) {
    out.push_back({detail::to_string(c10::OperatorName(e.name, e.overload)), e.policy});
  }
  std::sort(out.begin(), out.end(), [](const OpPolicy& a, const OpPolicy& b) { return a.op < b.op; });
  return out;
}

std::optional<CastPolicy> policy_for(std::string_view op, c10::DeviceType device) {
  for (const OpPolicy& row : policy_table(device)) {
    if (row.op == op) return row.policy;
  }
  return std::nullopt;
}

void register_op(std::string_view op, CastPolicy policy, std::optional<c10::DeviceType> device) {
  const c10::OperatorName name = detail::parse_op_name(op);
  detail::check_policy_fits(name, policy);
  std::vector<c10::DeviceType> devices;
  if (device) {
    detail::default_table(*device);  // validates the device
    devices.push_back(*device);
  } else {
    devices = {c10::DeviceType::CPU, c10::DeviceType::CUDA};
  }
  const detail::RegistrationLock held;
  detail::Registry& r = detail::registry();
  const std::shared_ptr<detail::CastingSession> live = detail::live_casting_session();
  for (c10::DeviceType d : devices) {
    const auto key = std::make_pair(detail::to_string(name), d);
    if (r.user.count(key) == 0) r.order.push_back(key);
    r.user.insert_or_assign(key, std::make_pair(name, policy));
    if (live) live->set_user_policy(name, d, policy);
  }
}

void register_half_function(std::string_view op, std::optional<c10::DeviceType> device) {
  register_op(op, CastPolicy::kLowerPrecision, device);
}
void register_float_function(std::string_view op, std::optional<c10::DeviceType> device) {
  register_op(op, CastPolicy::kFp32, device);
}
void register_promote_function(std::string_view op, std::optional<c10::DeviceType> device) {
  register_op(op, CastPolicy::kPromote, device);
}

void reset_user_registrations() {
  const detail::RegistrationLock held;
  detail::Registry& r = detail::registry();
  TORCH_CHECK(detail::live_casting_session() == nullptr, "amp: reset_user_registrations() while amp is initialized; "
              "call amp::deinitialize() first.");
  r.user.clear();
  r.order.clear();
}

}  // namespace amp
