// SPDX-License-Identifier: BSD-3-Clause
// Private: amp's own work as named ranges in LibTorch's profiler
// (torch::autograd::profiler, torch.profiler in Python), so a trace shows
// it under amp's names - "amp::cast" nested in the op it serves, the
// unscale, the scale update, fused steps, reductions, gathers,
// recomputation - instead of anonymous _to_copy and foreach kernels. The
// names are listed in docs/guide.md ("Where the time goes").
//
// With no profiler on, a range is one query of LibTorch's callbacks (about
// 100 instructions) and no RecordFunction (about 240 even then), and sits
// only around work done once per iteration or step; an op's casts check a
// flag instead (tracing()). Nothing is added to an op amp passes through.
// The inputs, whose shapes the profiler records when asked, are built only
// while profiling.
#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/macros/Macros.h>

#include <atomic>
#include <optional>
#include <utility>
#include <vector>

namespace amp::detail {

// Whether a profiler was on when amp last looked (at each guard's end, and
// at each weight's cast per iteration): per-call casts open a
// range only then, so an op's cast costs one load when none is on.
extern std::atomic<bool> g_tracing;
inline bool tracing() { return g_tracing.load(std::memory_order_relaxed); }
// Looks again (a query of LibTorch's callbacks).
void refresh_tracing();

class TraceRange {
 public:
  template <class... Inputs>
  explicit TraceRange(const char* name, const Inputs&... inputs) {
    std::optional<at::StepCallbacks> callbacks = at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE);
    if (C10_LIKELY(!callbacks.has_value())) return;
    g_tracing.store(true, std::memory_order_relaxed);
    range_.emplace(std::move(*callbacks));
    if (range_->needsInputs()) {
      const std::vector<c10::IValue> values{c10::IValue(inputs)...};
      range_->before(name, c10::ArrayRef<const c10::IValue>(values.data(), values.size()));
    } else {
      range_->before(name);
    }
  }
  TraceRange(const TraceRange&) = delete;
  TraceRange& operator=(const TraceRange&) = delete;

 private:
  std::optional<at::RecordFunction> range_;  // ends (its end callbacks run) with this object
};

}  // namespace amp::detail

// AMP_TRACE_RANGE("amp::name", inputs...): a range until the end of the scope.
#define AMP_TRACE_RANGE(...) ::amp::detail::TraceRange C10_ANONYMOUS_VARIABLE(amp_trace_range_)(__VA_ARGS__)
