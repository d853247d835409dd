#include <amp/casting_scope.h>

#include "casting_scope_internal.h"
#include "context.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace amp {
namespace detail {

ThreadCasting::ThreadCasting(const std::vector<DeviceCasting>& casting) {
  for (const DeviceCasting& c : casting) {
    saved_.push_back({c.device, at::autocast::is_autocast_enabled(c.device),
                      at::autocast::get_autocast_dtype(c.device)});
    // LibTorch's autocast dtype too, so native autocast kernels amp leaves in
    // place (aten::_cudnn_rnn, other libraries' ops) agree with amp's dtype.
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

disable_casts::disable_casts()
    : exclude_autocast_(c10::DispatchKeySet({c10::DispatchKey::AutocastCPU,
                                             c10::DispatchKey::AutocastCUDA})) {}

enable_casts::enable_casts() {
  std::shared_ptr<detail::Context> context = detail::require_live_context("amp::enable_casts");
  if (context->casting().empty()) return;  // this level does not intercept ops
  state_ = std::make_unique<detail::ThreadCasting>(context->casting());
  if (std::this_thread::get_id() != context->owner()) {
    context_ = context;
    context->worker_threads.fetch_add(1);
  }
}

enable_casts::~enable_casts() {
  state_.reset();
  if (auto context = std::static_pointer_cast<detail::Context>(context_)) {
    context->worker_threads.fetch_sub(1);
  }
}

}  // namespace amp
