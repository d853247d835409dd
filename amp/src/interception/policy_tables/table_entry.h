// SPDX-License-Identifier: BSD-3-Clause
// Private: the form of a policy-table row, and the macros the tables use.
//
// A row names an ATen operator through its generated at::_ops struct, so the
// name is checked at compile time and the row carries the unboxed kernel for
// that signature.
#pragma once

#include "interception/dispatch/typed_kernel.h"

#include <ATen/Operators.h>

#include <initializer_list>
#include <vector>

namespace amp::detail {

struct TableEntry {
  const char* name;      // "aten::conv1d"
  const char* overload;  // "padding", or "" for the default overload
  CastPolicy policy;
  KernelFactory make_kernel;
  // The op's low-precision kernel is oneDNN's alone: on a CPU where oneDNN
  // cannot run the low dtype (see hardware.h), the row runs in float32.
  bool needs_onednn_low_precision = false;
  // kBanned rows: why the op is unsafe in low precision and the safe
  // alternative, for the error amp raises (null: a generic explanation).
  const char* banned_because = nullptr;
};

template <class Op, class AppendTarget = void>
TableEntry table_entry(CastPolicy policy, bool needs_onednn_low_precision = false) {
  return {Op::name, Op::overload_name, policy, &make_typed_kernel<Op, AppendTarget>,
          needs_onednn_low_precision};
}

// The default tables, mirroring LibTorch 2.11's autocast_mode.cpp per device:
// the rows every device shares, then the device's own.
const std::vector<TableEntry>& shared_policy_rows();
std::vector<TableEntry> with_shared_rows(std::initializer_list<TableEntry> device_rows);
const std::vector<TableEntry>& cpu_policy_table();
const std::vector<TableEntry>& cuda_policy_table();
// Ops taking module parameters, bound at the levels that cast the model.
const std::vector<TableEntry>& model_policy_table();

}  // namespace amp::detail

#define AMP_OP(op, policy) ::amp::detail::table_entry<::at::_ops::op>(::amp::CastPolicy::policy)
// A banned row, with the reason and the safe alternative for its error.
#define AMP_OP_BANNED(op, because)                                                            \
  [] {                                                                                        \
    auto entry = ::amp::detail::table_entry<::at::_ops::op>(::amp::CastPolicy::kBanned);      \
    entry.banned_because = because;                                                           \
    return entry;                                                                             \
  }()
// A lower-precision row whose only low-precision kernel is oneDNN's.
#define AMP_OP_ONEDNN(op) \
  ::amp::detail::table_entry<::at::_ops::op>(::amp::CastPolicy::kLowerPrecision, /*needs_onednn_low_precision=*/true)
#define AMP_OP_OVERLOAD(op, overload, policy) \
  ::amp::detail::table_entry<::at::_ops::op##_##overload>(::amp::CastPolicy::policy)
// Registered as `op.overload`, redirected to `op.target` with a trailing dtype.
#define AMP_OP_APPEND_DTYPE(op, overload, target)                       \
  ::amp::detail::table_entry<::at::_ops::op##_##overload, ::at::_ops::op##_##target>( \
      ::amp::CastPolicy::kFp32AppendDtype)
