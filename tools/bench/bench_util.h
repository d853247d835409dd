// SPDX-License-Identifier: BSD-3-Clause
// Small timing and counting helpers for amp's benchmark programs.
#pragma once

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Nanoseconds per call of `fn`, timed over `calls` back-to-back calls.
inline double ns_per_call(const std::function<void()>& fn, int calls) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) fn();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / calls;
}

// Nanoseconds of one run of `timed`, after an untimed `setup`.
inline double ns_once(const std::function<void()>& setup, const std::function<void()>& timed) {
  setup();
  const auto start = std::chrono::steady_clock::now();
  timed();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
}

// Counts ATen calls whose name starts with one of `prefixes` on this thread
// while alive (via LibTorch's RecordFunction observers).
class OpCounter {
 public:
  explicit OpCounter(std::vector<std::string> prefixes);
  ~OpCounter();
  int64_t count() const { return count_; }

 private:
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn);
  std::vector<std::string> prefixes_;
  int64_t count_ = 0;
  at::CallbackHandle handle_;
};

// Counts, on this thread while alive, the ATen calls that would each launch
// one kernel on a GPU: calls that make no ATen call of their own, but for
// view, allocation and other metadata-only ops; a _foreach_, _fused_ or
// _scaled_mm call counts once, whatever it calls inside (the CPU's
// implementations loop over tensors or convert where CUDA runs one kernel).
class LaunchCounter {
 public:
  LaunchCounter();
  ~LaunchCounter();
  int64_t count() const { return count_; }

 private:
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn);
  static void on_end(const at::RecordFunction& fn, at::ObserverContext* context);
  struct Frame {
    bool opaque, metadata, has_child;
  };
  std::vector<Frame> frames_;
  int64_t count_ = 0;
  at::CallbackHandle handle_;
};

}  // namespace bench
