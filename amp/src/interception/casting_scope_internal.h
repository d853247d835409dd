// SPDX-License-Identifier: BSD-3-Clause
// Private: turning amp's casting on for one thread, restoring it exactly.
#pragma once

#include "interception/dispatch/op_binding.h"

#include <vector>

namespace amp::detail {

// Enables the autocast keys (and sets LibTorch's autocast dtype) of each
// device amp intercepts on the current thread; the destructor restores the
// previous values. Must be destroyed on the thread that created it.
class ThreadCasting {
 public:
  explicit ThreadCasting(const std::vector<DeviceCasting>& casting);
  ~ThreadCasting();
  ThreadCasting(const ThreadCasting&) = delete;
  ThreadCasting& operator=(const ThreadCasting&) = delete;

 private:
  struct Saved {
    c10::DeviceType device;
    bool enabled;
    c10::ScalarType dtype;
  };
  std::vector<Saved> saved_;
};

}  // namespace amp::detail
