#include "dispatch/call_record.h"

#include "dispatch/op_binding.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

namespace amp {
namespace detail {

std::atomic<bool> g_recording{false};

namespace {

thread_local CallRecord* t_current = nullptr;

using RowKey = std::tuple<std::string, int, int, bool, std::string, std::string>;

struct Rows {
  std::mutex mutex;
  std::map<RowKey, OpStats> rows;
};

Rows& rows() {
  static Rows* r = new Rows();
  return *r;
}

}  // namespace

CallRecord::CallRecord(const OpBinding& binding, CastPolicy applied, std::string input_dtypes)
    : previous_(t_current) {
  row_.op = binding.display_name;
  row_.device = binding.casting->device;
  row_.policy = applied;
  row_.input_dtypes = std::move(input_dtypes);
  row_.calls = 1;
  t_current = this;
}

CallRecord::~CallRecord() { t_current = previous_; }

void CallRecord::finish(std::string output_dtype) {
  row_.output_dtype = std::move(output_dtype);
  Rows& r = rows();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!g_recording.load(std::memory_order_relaxed)) return;
  const RowKey key{row_.op, static_cast<int>(row_.device), static_cast<int>(row_.policy),
                   row_.in_backward, row_.input_dtypes, row_.output_dtype};
  auto [it, inserted] = r.rows.emplace(key, row_);
  if (!inserted) {
    it->second.calls += row_.calls;
    it->second.casts += row_.casts;
    it->second.cache_hits += row_.cache_hits;
    it->second.bytes_cast += row_.bytes_cast;
  }
}

void CallRecord::note_cast(int64_t bytes) {
  if (CallRecord* r = t_current) {
    r->row_.casts += 1;
    r->row_.bytes_cast += bytes;
  }
}

void CallRecord::note_cache_hit() {
  if (CallRecord* r = t_current) r->row_.cache_hits += 1;
}

}  // namespace detail

OpStatsRecorder::OpStatsRecorder() {
  bool expected = false;
  TORCH_CHECK(detail::g_recording.compare_exchange_strong(expected, true),
              "amp: an OpStatsRecorder is already recording; only one may be alive at a time.");
  reset();
}

OpStatsRecorder::~OpStatsRecorder() { detail::g_recording.store(false); }

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

}  // namespace amp
