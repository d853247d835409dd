// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Per-op statistics of amp's interception: which ops ran, in which dtypes,
/// under which policy, and what was cast. The precision report
/// (tools/precision_report) prints them; tests assert them.
///
/// ```
///   amp::OpStatsRecorder recorder;          // records while alive
///   model->forward(x);
///   for (const amp::OpStats& s : recorder.stats()) ...
/// ```
///
/// Only one recorder may be alive at a time (a second one is an error).
/// Recording costs a lock per intercepted call; without a recorder the
/// kernels pay one relaxed atomic load.
#pragma once

#include <amp/cast_policy.h>

#include <c10/core/DeviceType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace amp {

/// One row per distinct (op, device, policy, input dtypes, output dtype).
struct OpStats {
  std::string op;  ///< "aten::linear"
  c10::DeviceType device = c10::DeviceType::CPU;  ///< the device the op ran on
  CastPolicy policy = CastPolicy::kPassthrough;  ///< the policy applied
  bool in_backward = false;  ///< called by autograd during backward (never cast)
  std::string input_dtypes;  ///< floating tensor arguments, "Float, BFloat16, -"
  std::string output_dtype;  ///< "BFloat16"; tuples as "(Float, Float)"
  int64_t calls = 0;  ///< intercepted calls that match this row
  int64_t casts = 0;       ///< tensors cast, cache misses included
  int64_t cache_hits = 0;  ///< weight casts served from the cast cache
  int64_t bytes_cast = 0;  ///< bytes of the cast copies made
  /// The fp8 property (opt_levels.h): calls run as scaled float8 GEMMs, and
  /// calls that qualified but ran in bfloat16: shapes the device's float8
  /// kernel cannot take (on CUDA: dimensions not multiples of 16), or too
  /// few multiply-adds per element to pay (Fp8Scaling::min_gemm_intensity).
  int64_t float8 = 0;
  int64_t float8_fallbacks = 0;  ///< calls that qualified for float8 but ran in bfloat16 (see float8)
};

/// Records OpStats of every intercepted call while it lives; at most one at a
/// time (see op_stats.h).
class OpStatsRecorder {
 public:
  OpStatsRecorder();
  ~OpStatsRecorder();
  OpStatsRecorder(const OpStatsRecorder&) = delete;
  OpStatsRecorder& operator=(const OpStatsRecorder&) = delete;

  /// Rows sorted by op, device, input dtypes.
  std::vector<OpStats> stats() const;
  /// Forgets the rows recorded so far.
  void reset();
};

/// The rows as a Markdown table: op, device, policy, input dtypes, output
/// dtype, calls, casts, cache hits, bytes cast, and where any row has them
/// the float8 and float8 fallback counts (what tools/precision_report
/// prints).
std::string format_op_stats(const std::vector<OpStats>& rows);

}  // namespace amp
