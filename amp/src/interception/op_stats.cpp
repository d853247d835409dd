// SPDX-License-Identifier: BSD-3-Clause
// The OpStatsRecorder: the rows kernels report while one records, and their
// table.
#include <amp/op_stats.h>

#include "interception/dispatch/call_record.h"

#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

namespace amp {
namespace detail {

std::atomic<int> g_observers{0};

namespace {

// Calls with the same op, device, policy, direction and dtypes share a row.
using RowKey = std::tuple<std::string, int, int, bool, std::string, std::string>;

struct Rows {
  std::mutex mutex;
  std::map<RowKey, OpStats> rows;
};

Rows& rows() {
  static Rows* r = new Rows();  // leaked: kernels may report during static destruction
  return *r;
}

}  // namespace

void add_op_stats(const OpStats& row) {
  if (recomputing()) return;  // forward counted these calls
  Rows& r = rows();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!recording()) return;
  const RowKey key{row.op, static_cast<int>(row.device), static_cast<int>(row.policy),
                   row.in_backward, row.input_dtypes, row.output_dtype};
  auto [it, inserted] = r.rows.emplace(key, row);
  if (!inserted) {
    it->second.calls += row.calls;
    it->second.casts += row.casts;
    it->second.cache_hits += row.cache_hits;
    it->second.bytes_cast += row.bytes_cast;
    it->second.float8 += row.float8;
    it->second.float8_fallbacks += row.float8_fallbacks;
  }
}

}  // namespace detail

OpStatsRecorder::OpStatsRecorder() {
  const int before = detail::g_observers.fetch_or(detail::kOpStats);
  TORCH_CHECK((before & detail::kOpStats) == 0,
              "amp: an OpStatsRecorder is already recording; only one may be alive at a time.");
  reset();
}

OpStatsRecorder::~OpStatsRecorder() { detail::g_observers.fetch_and(~detail::kOpStats); }

std::vector<OpStats> OpStatsRecorder::stats() const {
  auto& r = detail::rows();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<OpStats> out;
  for (const auto& [key, row] : r.rows) out.push_back(row);
  return out;
}

void OpStatsRecorder::reset() {
  auto& r = detail::rows();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.rows.clear();
}

std::string format_op_stats(const std::vector<OpStats>& rows) {
  std::ostringstream out;
  const bool float8 = std::any_of(rows.begin(), rows.end(),
                                  [](const OpStats& r) { return r.float8 > 0 || r.float8_fallbacks > 0; });
  out << "| op | device | policy | input dtypes | output | calls | casts | cache hits | bytes cast |"
      << (float8 ? " float8 | float8 fallbacks |" : "") << "\n"
      << "|---|---|---|---|---|---:|---:|---:|---:|" << (float8 ? "---:|---:|" : "") << "\n";
  for (const OpStats& r : rows) {
    out << "| " << r.op << " | " << c10::DeviceTypeName(r.device, /*lower_case=*/true) << " | "
        << to_string(r.policy) << (r.in_backward ? " (backward)" : "") << " | " << r.input_dtypes
        << " | " << r.output_dtype << " | " << r.calls << " | " << r.casts << " | " << r.cache_hits
        << " | " << r.bytes_cast << " |";
    if (float8) out << " " << r.float8 << " | " << r.float8_fallbacks << " |";
    out << "\n";
  }
  return out.str();
}

}  // namespace amp
