// SPDX-License-Identifier: BSD-3-Clause
// Internal: the process-wide amp::Handle behind the free functions of
// initialize.h. Not part of the API: use amp::initialize, amp::deinitialize
// and amp::is_initialized.
#pragma once

namespace amp {

class Handle;

namespace internal {

// Never destroyed.
Handle& global_handle();

}  // namespace internal
}  // namespace amp
