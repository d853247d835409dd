// Private: user registrations (register_half_function & co.) and the live
// interceptor they must reach when amp is already initialized.
#pragma once

#include <amp/cast_policy.h>

#include <ATen/core/operator_name.h>

#include <utility>
#include <vector>

namespace amp::detail {

class Interceptor;

// The user's registrations for `device`, in registration order.
std::vector<std::pair<c10::OperatorName, CastPolicy>> user_registrations(c10::DeviceType device);

// Registrations made while `interceptor` is live apply to it at once.
void set_live_interceptor(Interceptor* interceptor);

}  // namespace amp::detail
