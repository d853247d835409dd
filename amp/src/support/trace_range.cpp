// SPDX-License-Identifier: BSD-3-Clause
#include "support/trace_range.h"

namespace amp::detail {

std::atomic<bool> g_tracing{false};

void refresh_tracing() {
  g_tracing.store(at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE).has_value(),
                  std::memory_order_relaxed);
}

}  // namespace amp::detail
