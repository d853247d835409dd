// SPDX-License-Identifier: BSD-3-Clause
// Private: how a kernel reports one call to the live OpStatsRecorder
// (op_stats.cpp holds the recorder and its rows).
#pragma once

#include <amp/op_stats.h>

#include "interception/dispatch/cast.h"

#include <ATen/core/IListRef.h>
#include <ATen/core/Tensor.h>

#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace amp::detail {

struct OpBinding;

// Who observes intercepted calls, as bits. Kernels read the whole word once
// and take their observed path while any bit is set, so observers cost
// nothing when none is on.
enum Observer : int {
  kOpStats = 1,       // an OpStatsRecorder lives: kernels report every call
  kForwardWatch = 2,  // a context with overflow provenance lives (forward_watch.h)
  kMeasuredPolicy = 4,  // a context with Options::measured_policy lives (measured_policy.h)
};
extern std::atomic<int> g_observers;
inline bool observing() { return g_observers.load(std::memory_order_relaxed) != 0; }
inline bool recording() { return (g_observers.load(std::memory_order_relaxed) & kOpStats) != 0; }
inline bool measuring() { return (g_observers.load(std::memory_order_relaxed) & kMeasuredPolicy) != 0; }
// Adds one call's row to the recorder's table (dropped when none records).
void add_op_stats(const OpStats& row);

// Collects one intercepted call: arguments before casting, casts made while
// it is the thread's current record, and the output dtype. Backward calls
// are reported as pass-through: amp never casts there.
class CallRecord {
 public:
  CallRecord(const OpBinding& binding, CastPolicy policy, std::string input_dtypes);
  ~CallRecord();
  CallRecord(const CallRecord&) = delete;
  CallRecord& operator=(const CallRecord&) = delete;

  // The policy this call applies: the binding's, or pass-through in backward.
  CastPolicy policy() const { return row_.policy; }
  void finish(std::string output_dtype);

  // Called by the cast path for the thread's current record, if any; a
  // global flag read, not a thread-local one, when nothing records.
  static void note_cast(const at::Tensor& copy) {
    if (C10_UNLIKELY(recording())) add_cast(copy);
  }
  static void note_cache_hit() {
    if (C10_UNLIKELY(recording())) add_cache_hit();
  }
  // A qualifying GEMM ran in float8, or fell back to bfloat16 for its shapes.
  static void note_float8(bool fell_back) {
    if (C10_UNLIKELY(recording())) add_float8(fell_back);
  }

 private:
  static void add_cast(const at::Tensor& copy);
  static void add_cache_hit();
  static void add_float8(bool fell_back);

  OpStats row_;
  CallRecord* previous_;
};

// Dtype descriptions of arguments and results: "BFloat16, Float", "-" for
// an undefined tensor.
inline void describe(std::string& out, const at::Tensor& t) {
  if (!out.empty()) out += ", ";
  out += t.defined() ? c10::toString(t.scalar_type()) : "-";
}
// `view`: the arguments of a call (TypedArgs, BoxedArgs).
template <class View>
std::string describe_tensors(const View& view) {
  std::string out;
  view.for_each_tensor([&](const at::Tensor& t, bool) { describe(out, t); });
  return out;
}
// "[64, 256] Float, [256] Float": the floating tensor arguments' shapes and
// dtypes (the measured policy's key).
template <class View>
std::string describe_shapes(const View& view) {
  std::string out;
  view.for_each_tensor([&](const at::Tensor& t, bool) {
    if (!t.defined() || !t.is_floating_point()) return;
    if (!out.empty()) out += ", ";
    out += c10::str(t.sizes(), " ", t.scalar_type());
  });
  return out;
}
template <class... Ts>
std::string describe_result(const std::tuple<Ts...>& result) {
  std::string out;
  for (const at::Tensor& t : result_tensors(result)) describe(out, t);
  return "(" + out + ")";
}
template <class T>
std::string describe_result(const T& result) {
  std::string out;
  for (const at::Tensor& t : result_tensors(result)) describe(out, t);
  return out;
}

}  // namespace amp::detail
