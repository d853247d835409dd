// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// RAII scopes that change amp's per-op casting on one thread, and a helper
/// that carries a thread's casting state to another thread.
///
/// disable_casts: inside it, amp's interception does nothing on this thread -
/// ops run in the dtypes of their inputs (Apex's amp.disable_casts(),
/// torch.autocast(enabled=False)). Use it around code that must see exact
/// fp32 math, e.g. a metric on fp32 tensors.
///
/// ```
///   {
///     amp::disable_casts no_casts;
///     auto exact = torch::mm(a, b);  // fp32 in, fp32 out, even under O1
///   }
/// ```
///
/// cast_dtype: a region that casts to another low-precision dtype, as a
/// nested torch.autocast(dtype=...):
///
/// ```
///   {
///     amp::cast_dtype half(c10::kHalf);  // on CPU and CUDA; or cast_dtype(c10::kHalf, c10::kCPU)
///     auto y = torch::mm(a, b);          // float16 inside, bfloat16 (CPU's default) outside
///   }
/// ```
///
/// At O2/O3/O5 lower-precision ops follow the dtype of their weights; the
/// region's dtype applies where an op meets no low-precision weight.
///
/// disable_cast_cache: inside it, fp32 weights are cast afresh at every op
/// instead of once per iteration (torch.autocast(cache_enabled=False)), for
/// inference loops that edit weights through w.data() between forward passes
/// (see cast_cache.h).
///
/// enable_casts: turns amp's casting on for the current thread. The thread that
/// calls amp::initialize is enabled for amp's lifetime; worker threads that
/// run a forward pass need their own scope, or run a callable wrapped by
/// with_current_casts (below):
///
/// ```
///   std::thread worker([&] {
///     amp::enable_casts casts;  // casts as on the initializing thread
///     auto y = model->forward(x);
///   });
/// ```
///
/// All nest and restore exactly the thread state they changed, also when an
/// exception leaves the scope. None can be copied or moved.
///
/// Errors (c10::Error): enable_casts and cast_dtype when amp is not
/// initialized (for enable_casts on another thread: also while
/// amp::deinitialize() is ending it); cast_dtype with a dtype other than
/// float16/bfloat16. Under levels that do not intercept ops (O0)
/// enable_casts does nothing. While an enable_casts scope lives on a thread
/// other than the initializing one, amp::deinitialize() refuses to run.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <memory>
#include <optional>
#include <utility>

namespace amp {

/// RAII: while it lives, amp's interception does nothing on this thread and
/// ops run in the dtypes of their inputs (see casting_scope.h).
class [[nodiscard]] disable_casts {
 public:
  disable_casts();
  ~disable_casts();
  disable_casts(const disable_casts&) = delete;
  disable_casts& operator=(const disable_casts&) = delete;

 private:
  bool cpu_was_excluded_, cuda_was_excluded_;
};

/// RAII: turns amp's casting on for the current thread while it lives, for
/// worker threads that run a forward pass (see casting_scope.h).
class [[nodiscard]] enable_casts {
 public:
  enable_casts();
  ~enable_casts();
  enable_casts(const enable_casts&) = delete;
  enable_casts& operator=(const enable_casts&) = delete;

 private:
  class Scope;  // the thread's saved autocast state; on worker threads, amp's count of them
  std::unique_ptr<Scope> scope_;
};

/// RAII: while it lives, this thread's ops cast to another low-precision
/// dtype, as a nested torch.autocast(dtype=...) (see casting_scope.h).
class [[nodiscard]] cast_dtype {
 public:
  /// `device`: the device whose ops cast to `dtype`; CPU and CUDA when unset.
  explicit cast_dtype(c10::ScalarType dtype, std::optional<c10::DeviceType> device = std::nullopt);
  ~cast_dtype();
  cast_dtype(const cast_dtype&) = delete;
  cast_dtype& operator=(const cast_dtype&) = delete;

 private:
  std::optional<c10::ScalarType> cpu_before_, cuda_before_;
};

/// RAII: while it lives, fp32 weights are cast afresh at every op on this
/// thread instead of once per iteration (see casting_scope.h).
class [[nodiscard]] disable_cast_cache {
 public:
  disable_cast_cache();
  ~disable_cast_cache();
  disable_cast_cache(const disable_cast_cache&) = delete;
  disable_cast_cache& operator=(const disable_cast_cache&) = delete;

 private:
  bool was_enabled_;
};

/// The calling thread's casting state: whether amp casts here (enable_casts,
/// disable_casts), each device's low dtype (cast_dtype) and the cast cache
/// switch (disable_cast_cache). Cheap to copy.
class CastingState {
 public:
  /// The calling thread's casting state now.
  static CastingState current();
  /// A state written out, e.g. one saved from current() and carried along.
  CastingState(bool casts, c10::ScalarType cpu_dtype, c10::ScalarType cuda_dtype, bool cache_enabled)
      : casts_(casts), cpu_dtype_(cpu_dtype), cuda_dtype_(cuda_dtype), cache_(cache_enabled) {}

  bool casts() const { return casts_; }  ///< amp casts this thread's ops
  /// The low-precision dtype ops on `device` cast to (CUDA's on CUDA, the
  /// CPU's on every other device type).
  c10::ScalarType dtype(c10::DeviceType device) const {
    return device == c10::DeviceType::CUDA ? cuda_dtype_ : cpu_dtype_;
  }
  /// Whether the cast cache serves this thread's casts (no
  /// disable_cast_cache scope).
  bool cache_enabled() const { return cache_; }

 private:
  bool casts_;
  c10::ScalarType cpu_dtype_, cuda_dtype_;
  bool cache_;
};

/// RAII: gives the current thread `state`, restoring its own on exit.
/// Errors: `state` casts but amp is no longer initialized.
class [[nodiscard]] with_casting_state {
 public:
  /// Gives the current thread `state` until the scope ends.
  explicit with_casting_state(const CastingState& state);
  ~with_casting_state();
  with_casting_state(const with_casting_state&) = delete;
  with_casting_state& operator=(const with_casting_state&) = delete;

 private:
  // In place, no allocation; they end in reverse order: cache, dtypes, casting.
  std::optional<enable_casts> enable_;
  std::optional<disable_casts> disable_;
  std::optional<cast_dtype> cpu_dtype_, cuda_dtype_;
  std::optional<disable_cast_cache> no_cache_;
};

/// Wraps `fn` so that whichever thread calls it runs it with the casting state
/// of the thread that wrapped it - what a thread pool, a DataParallel-style
/// replica or a data pipeline running forward needs:
///
/// ```
///   auto forward = amp::with_current_casts([&](const at::Tensor& x) { return model->forward(x); });
///   std::thread worker([&] { y = forward(x); });  // casts as the wrapping thread does
/// ```
///
/// Errors: as with_casting_state, when the wrapped callable runs.
template <class Fn>
auto with_current_casts(Fn fn) {
  return [state = CastingState::current(), fn = std::move(fn)](auto&&... args) mutable -> decltype(auto) {
    with_casting_state scope(state);
    return fn(std::forward<decltype(args)>(args)...);
  };
}

}  // namespace amp
