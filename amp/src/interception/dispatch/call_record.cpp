// SPDX-License-Identifier: BSD-3-Clause
#include "interception/dispatch/call_record.h"

#include "interception/dispatch/op_binding.h"

namespace amp::detail {
namespace {

thread_local CallRecord* t_current = nullptr;

}  // namespace

CallRecord::CallRecord(const OpBinding& binding, CastPolicy policy, std::string input_dtypes)
    : previous_(t_current) {
  row_.op = binding.display_name;
  row_.device = binding.casting->device;
  row_.in_backward = policy != CastPolicy::kPassthrough && in_backward();
  row_.policy = row_.in_backward ? CastPolicy::kPassthrough : policy;
  row_.input_dtypes = std::move(input_dtypes);
  row_.calls = 1;
  t_current = this;
}

CallRecord::~CallRecord() { t_current = previous_; }

void CallRecord::finish(std::string output_dtype) {
  row_.output_dtype = std::move(output_dtype);
  add_op_stats(row_);
}

void CallRecord::add_cast(const at::Tensor& copy) {
  if (CallRecord* r = t_current) {
    r->row_.casts += 1;
    r->row_.bytes_cast += static_cast<int64_t>(copy.nbytes());
  }
}

void CallRecord::add_cache_hit() {
  if (CallRecord* r = t_current) r->row_.cache_hits += 1;
}

void CallRecord::add_float8(bool fell_back) {
  if (CallRecord* r = t_current) (fell_back ? r->row_.float8_fallbacks : r->row_.float8) += 1;
}

}  // namespace amp::detail
