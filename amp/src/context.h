// Private: one live initialization of amp - its properties, loss scalers,
// dispatcher interception and the initializing thread's casting state.
#pragma once

#include <amp/loss_scaler.h>
#include <amp/options.h>

#include "dispatch/op_binding.h"

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

namespace amp::detail {

class Interceptor;
class RegistrationLock;
class ThreadCasting;

// Host-side count of consecutive skipped steps per loss, to keep the log
// concise when the scale sits at its floor.
struct SkipLog {
  int consecutive = 0;
};

class Context {
 public:
  // `held`: the user's registrations cannot change while the interceptor
  // reads them (see start_live_context).
  Context(const Properties& properties, const Options& options, const RegistrationLock& held);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  const Properties& properties() const { return properties_; }
  const Options& options() const { return options_; }
  int verbosity() const { return options_.verbosity; }
  int num_losses() const { return static_cast<int>(scalers_.size()); }
  LossScaler& scaler(int loss_id);
  SkipLog& skip_log(int loss_id) { return skip_logs_.at(loss_id); }

  // How this initialization casts per device; empty when it does not
  // intercept ops (O0).
  const std::vector<DeviceCasting>& casting() const { return casting_; }

  // Applies a user registration (register_op) to the interceptor; the
  // caller holds the RegistrationLock.
  void set_user_policy(const c10::OperatorName& op, c10::DeviceType device, CastPolicy policy);

  // Removes every dispatcher registration and the owner thread's casting
  // state. Idempotent. Errors leave everything in place.
  void shutdown();
  bool live() const { return !shut_down_; }
  std::thread::id owner() const { return owner_; }

  std::atomic<int> worker_threads{0};  // live enable_casts scopes on other threads

  // Distributed training: combines the overflow flags of every rank (MAX),
  // so all ranks skip together. No-op without a process group.
  void reduce_overflow(at::Tensor& found_inf) const {
    if (overflow_reducer_) overflow_reducer_(found_inf);
  }

 private:
  void teardown();

  Properties properties_;
  Options options_;
  std::vector<DeviceCasting> casting_;
  std::vector<std::unique_ptr<LossScaler>> scalers_;
  std::vector<SkipLog> skip_logs_;
  std::unique_ptr<Interceptor> interceptor_;
  std::unique_ptr<ThreadCasting> owner_casting_;
  std::thread::id owner_;
  bool shut_down_ = false;
  std::function<void(at::Tensor&)> overflow_reducer_;
};

// The live context is the one record of "amp is live": at most one exists,
// published by start_live_context and cleared by end_live_context (both
// serialized by amp::initialize's own lock, and both holding the
// RegistrationLock so that user registrations reach exactly the live one).

// The live context, or null.
std::shared_ptr<Context> live_context();
// Like live_context(), but throws "amp is not initialized" with `what`.
std::shared_ptr<Context> require_live_context(const char* what);
// Builds a context and makes it the live one.
std::shared_ptr<Context> start_live_context(const Properties& properties, const Options& options);
// Shuts `context` (the live one) down and clears the live slot. On error
// (see Context::shutdown) it stays live.
void end_live_context(const std::shared_ptr<Context>& context);

}  // namespace amp::detail
