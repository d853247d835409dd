// Private: the live initialization as the interception layer sees it - how
// it casts per device, the thread that owns that state, the scopes other
// threads open, and the user registrations it applies. The session
// (session/context.h) implements it.
#pragma once

#include <amp/cast_policy.h>

#include "interception/dispatch/op_binding.h"

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

// The live session (sharing ownership of the whole initialization), or null.
std::shared_ptr<CastingSession> live_casting_session();
// Like live_casting_session(), but throws "amp is not initialized" with `what`.
std::shared_ptr<CastingSession> require_casting_session(const char* what);

}  // namespace amp::detail
