// SPDX-License-Identifier: BSD-3-Clause
#include <amp/casting_scope.h>
#include <amp/internal/level_rules.h>

#include <amp/opt_levels.h>

#include "interception/casting_scope_internal.h"
#include "interception/casting_session.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <memory>
#include <optional>
#include <thread>

namespace amp {
namespace detail {

LiveSlot<CastingSession>& live_casting_slot() {
  static LiveSlot<CastingSession> slot;
  return slot;
}

ThreadCasting::ThreadCasting(const std::vector<DeviceCasting>& casting) {
  for (const DeviceCasting& c : casting) {
    saved_.push_back({c.device, at::autocast::is_autocast_enabled(c.device),
                      at::autocast::get_autocast_dtype(c.device)});
    // amp's kernels read the thread's autocast dtype (cast_dtype changes it);
    // LibTorch's native autocast kernels amp leaves in place (aten::_cudnn_rnn,
    // other libraries' ops) read it too and so agree with amp.
    at::autocast::set_autocast_dtype(c.device, c.low_dtype);
    at::autocast::set_autocast_enabled(c.device, true);
  }
}

ThreadCasting::~ThreadCasting() {
  for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
    at::autocast::set_autocast_enabled(it->device, it->enabled);
    at::autocast::set_autocast_dtype(it->device, it->dtype);
  }
}

}  // namespace detail

namespace {

constexpr c10::DispatchKey kAutocastCPU = c10::DispatchKey::AutocastCPU;
constexpr c10::DispatchKey kAutocastCUDA = c10::DispatchKey::AutocastCUDA;

bool excluded(c10::DispatchKey key) { return c10::impl::tls_is_dispatch_key_excluded(key); }

}  // namespace

disable_casts::disable_casts()
    : cpu_was_excluded_(excluded(kAutocastCPU)), cuda_was_excluded_(excluded(kAutocastCUDA)) {
  c10::impl::tls_set_dispatch_key_excluded(kAutocastCPU, true);
  c10::impl::tls_set_dispatch_key_excluded(kAutocastCUDA, true);
}

disable_casts::~disable_casts() {
  c10::impl::tls_set_dispatch_key_excluded(kAutocastCPU, cpu_was_excluded_);
  c10::impl::tls_set_dispatch_key_excluded(kAutocastCUDA, cuda_was_excluded_);
}

// On a worker thread the context counts the scope, before the thread casts
// (so deinitialize sees it) until after it stops.
class enable_casts::Scope {
 public:
  explicit Scope(std::shared_ptr<detail::CastingSession> context) {
    if (std::this_thread::get_id() != context->owner()) {
      TORCH_CHECK(context->add_worker(), "amp: amp::enable_casts needs amp to be initialized; it "
                  "was being deinitialized. Open the scope while amp is live.");
      worker_of_ = context;
    }
    try {
      casting_.emplace(context->casting());
    } catch (...) {
      if (worker_of_) worker_of_->remove_worker();
      throw;
    }
  }
  ~Scope() {
    casting_.reset();
    if (worker_of_) worker_of_->remove_worker();
  }

 private:
  std::shared_ptr<detail::CastingSession> worker_of_;
  std::optional<detail::ThreadCasting> casting_;
};

enable_casts::enable_casts() {
  std::shared_ptr<detail::CastingSession> context = detail::require_casting_session("amp::enable_casts");
  if (context->casting().empty()) return;  // this level does not intercept ops
  scope_ = std::make_unique<Scope>(std::move(context));
}

enable_casts::~enable_casts() = default;

cast_dtype::cast_dtype(c10::ScalarType dtype, std::optional<c10::DeviceType> device) {
  detail::require_casting_session("amp::cast_dtype");
  TORCH_CHECK(internal::is_low_precision(dtype), "amp: cast_dtype needs float16 (c10::kHalf) or bfloat16 "
              "(c10::kBFloat16), got ", dtype, ". For a region without casts use amp::disable_casts.");
  TORCH_CHECK(!device || *device == c10::DeviceType::CPU || *device == c10::DeviceType::CUDA,
              "amp: cast_dtype applies to CPU or CUDA, got device ", *device);
  for (c10::DeviceType d : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
    if (device && *device != d) continue;
    (d == c10::DeviceType::CPU ? cpu_before_ : cuda_before_) = at::autocast::get_autocast_dtype(d);
    at::autocast::set_autocast_dtype(d, dtype);
  }
}

cast_dtype::~cast_dtype() {
  if (cpu_before_) at::autocast::set_autocast_dtype(c10::DeviceType::CPU, *cpu_before_);
  if (cuda_before_) at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, *cuda_before_);
}

disable_cast_cache::disable_cast_cache() : was_enabled_(at::autocast::is_autocast_cache_enabled()) {
  at::autocast::set_autocast_cache_enabled(false);
}

disable_cast_cache::~disable_cast_cache() { at::autocast::set_autocast_cache_enabled(was_enabled_); }

CastingState CastingState::current() {
  bool casts = false;
  const std::shared_ptr<detail::CastingSession> context = detail::live_casting_session();
  for (const detail::DeviceCasting& c : context ? context->casting() : std::vector<detail::DeviceCasting>{}) {
    casts = casts || (at::autocast::is_autocast_enabled(c.device) && !excluded(c.autocast_key));
  }
  return CastingState(casts, at::autocast::get_autocast_dtype(c10::DeviceType::CPU),
                      at::autocast::get_autocast_dtype(c10::DeviceType::CUDA),
                      at::autocast::is_autocast_cache_enabled());
}

with_casting_state::with_casting_state(const CastingState& state) {
  if (state.casts()) {
    enable_.emplace();
    cpu_dtype_.emplace(state.dtype(c10::DeviceType::CPU), c10::DeviceType::CPU);
    cuda_dtype_.emplace(state.dtype(c10::DeviceType::CUDA), c10::DeviceType::CUDA);
  } else {
    disable_.emplace();
  }
  if (!state.cache_enabled()) no_cache_.emplace();
}

with_casting_state::~with_casting_state() = default;

}  // namespace amp
