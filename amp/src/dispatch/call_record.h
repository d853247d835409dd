// Private: how a kernel reports one call to the live OpStatsRecorder.
#pragma once

#include <amp/op_stats.h>

#include <ATen/core/IListRef.h>
#include <ATen/core/Tensor.h>

#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace amp::detail {

struct OpBinding;

extern std::atomic<bool> g_recording;
inline bool recording() { return g_recording.load(std::memory_order_relaxed); }

// Collects one intercepted call: arguments before casting, casts made while
// it is the thread's current record, and the output dtype.
class CallRecord {
 public:
  CallRecord(const OpBinding& binding, CastPolicy applied, std::string input_dtypes);
  ~CallRecord();
  CallRecord(const CallRecord&) = delete;
  CallRecord& operator=(const CallRecord&) = delete;

  void set_in_backward(bool in_backward) { row_.in_backward = in_backward; }
  void finish(std::string output_dtype);

  // Called by the cast path for the thread's current record, if any.
  static void note_cast(int64_t bytes);
  static void note_cache_hit();

 private:
  OpStats row_;
  CallRecord* previous_;
};

// Dtype descriptions of arguments and results.
inline void describe(std::string& out, const at::Tensor& t) {
  if (!out.empty()) out += ", ";
  out += t.defined() ? c10::toString(t.scalar_type()) : "-";
}
inline void describe(std::string& out, const std::optional<at::Tensor>& t) {
  if (t) describe(out, *t);
}
inline void describe(std::string& out, at::TensorList list) {
  for (const auto& t : list) describe(out, t);
}
inline void describe(std::string& out, const at::ITensorListRef& list) {
  for (const auto& t : list) describe(out, t);
}
template <class T>
inline void describe(std::string&, const T&) {}

template <class... Args>
std::string describe_args(const Args&... args) {
  std::string out;
  (describe(out, args), ...);
  return out;
}
template <class... Ts>
std::string describe_result(const std::tuple<Ts...>& result) {
  std::string out;
  std::apply([&](const auto&... items) { (describe(out, items), ...); }, result);
  return "(" + out + ")";
}
template <class T>
std::string describe_result(const T& result) {
  std::string out;
  describe(out, result);
  return out;
}

}  // namespace amp::detail
