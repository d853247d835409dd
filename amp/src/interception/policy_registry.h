// SPDX-License-Identifier: BSD-3-Clause
// Private: the user's registrations (register_half_function & co.) and how
// they reach the live context.
//
// The live context (context.h) is the one owner of "amp is live"; its
// interceptor holds the bindings. A registration must reach it exactly once:
// either it is read while the interceptor is built, or it is applied to the
// live interceptor. RegistrationLock makes that so: register_op holds it, and
// so do building and publishing a context and retiring it, so no
// registration lands between building an interceptor and publishing it, or
// reaches one being torn down.
#pragma once

#include <amp/cast_policy.h>

#include <ATen/core/operator_name.h>

#include <mutex>
#include <utility>
#include <vector>

namespace amp::detail {

class RegistrationLock {
 public:
  RegistrationLock();

 private:
  std::unique_lock<std::mutex> lock_;
};

// The user's registrations for `device`, in registration order.
std::vector<std::pair<c10::OperatorName, CastPolicy>> user_registrations(const RegistrationLock& held,
                                                                         c10::DeviceType device);

}  // namespace amp::detail
