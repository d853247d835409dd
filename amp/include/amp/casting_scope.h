// RAII scopes that switch amp's per-op casting off or on for one thread.
//
// disable_casts: inside it, amp's interception does nothing on this thread -
// ops run in the dtypes of their inputs (Apex's amp.disable_casts()). Use it
// around code that must see exact fp32 math, e.g. a metric on fp32 tensors.
//
//   {
//     amp::disable_casts no_casts;
//     auto exact = torch::mm(a, b);  // fp32 in, fp32 out, even under O1
//   }
//
// enable_casts: turns amp's casting on for the current thread. The thread that
// calls amp::initialize is enabled for amp's lifetime; worker threads that
// run a forward pass need their own scope:
//
//   std::thread worker([&] {
//     amp::enable_casts casts;  // casts as on the initializing thread
//     auto y = model->forward(x);
//   });
//
// Both nest and restore exactly the thread state they changed, also when an
// exception leaves the scope. Neither can be copied or moved.
//
// Errors (c10::Error from enable_casts): amp is not initialized. Under levels
// that do not intercept ops (O0) enable_casts does nothing. While an
// enable_casts scope lives on a thread other than the initializing one,
// amp::deinitialize() refuses to run.
#pragma once

#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <memory>

namespace amp {

class [[nodiscard]] disable_casts {
 public:
  disable_casts();
  disable_casts(const disable_casts&) = delete;
  disable_casts& operator=(const disable_casts&) = delete;

 private:
  c10::impl::ExcludeDispatchKeyGuard exclude_autocast_;
};

namespace detail {
class ThreadCasting;
}

class [[nodiscard]] enable_casts {
 public:
  enable_casts();
  ~enable_casts();
  enable_casts(const enable_casts&) = delete;
  enable_casts& operator=(const enable_casts&) = delete;

 private:
  std::unique_ptr<detail::ThreadCasting> state_;
  std::shared_ptr<void> context_;  // set on worker threads: counted by amp's context
};

}  // namespace amp
