// SPDX-License-Identifier: BSD-3-Clause
// Private: where a layer finds the live initialization.
//
// The session layer (session/context.cpp) builds the live context and
// publishes it into each lower layer's slot, as that layer's own interface
// (CastingSession, StepSession, RecomputeSession), when an initialization
// starts, and withdraws it when it ends. Each slot is defined in the layer
// that reads it, so finding the live initialization never calls up a layer.
#pragma once

#include <c10/util/Exception.h>

#include <memory>
#include <mutex>
#include <utility>

namespace amp::detail {

template <class Session>
class LiveSlot {
 public:
  // The live session (sharing ownership of the whole initialization), or null.
  std::shared_ptr<Session> get() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return session_;
  }
  // Like get(), but throws "amp is not initialized" with `what`.
  std::shared_ptr<Session> require(const char* what) const {
    std::shared_ptr<Session> session = get();
    TORCH_CHECK(session != nullptr, "amp: ", what, " needs amp to be initialized; call "
                "amp::initialize(model, optimizer, opt_level) first.");
    return session;
  }
  // The session layer's: publishes `session`, or withdraws it (null).
  void set(std::shared_ptr<Session> session) {
    std::lock_guard<std::mutex> lock(mutex_);
    session_ = std::move(session);
  }

 private:
  mutable std::mutex mutex_;
  std::shared_ptr<Session> session_;
};

}  // namespace amp::detail
