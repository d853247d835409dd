// SPDX-License-Identifier: BSD-3-Clause
// Private: the live initialization as the interception layer sees it - how
// it casts per device, the thread that owns that state, the scopes other
// threads open, and the user registrations it applies. The session
// (session/context.h) implements it.
#pragma once

#include <amp/cast_policy.h>

#include "interception/dispatch/op_binding.h"
#include "support/live_slot.h"

#include <memory>
#include <thread>
#include <vector>

namespace amp::detail {

class CastingSession {
 public:
  // How this initialization casts per device; empty when it does not
  // intercept ops (O0).
  virtual const std::vector<DeviceCasting>& casting() const = 0;
  virtual std::thread::id owner() const = 0;
  // enable_casts scopes on other threads. They are counted under the lock
  // shutdown checks them under, so a scope either counts before shutdown
  // looks, or finds it begun and is refused (add_worker returns false).
  virtual bool add_worker() = 0;
  virtual void remove_worker() = 0;
  // Applies a user registration (register_op) to the interceptor; the
  // caller holds the RegistrationLock.
  virtual void set_user_policy(const c10::OperatorName& op, c10::DeviceType device, CastPolicy policy) = 0;

 protected:
  ~CastingSession() = default;
};

// The live session: published by the session layer (support/live_slot.h).
LiveSlot<CastingSession>& live_casting_slot();
inline std::shared_ptr<CastingSession> live_casting_session() { return live_casting_slot().get(); }
inline std::shared_ptr<CastingSession> require_casting_session(const char* what) {
  return live_casting_slot().require(what);
}

}  // namespace amp::detail
