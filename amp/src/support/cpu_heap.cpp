// SPDX-License-Identifier: BSD-3-Clause
#include "support/cpu_heap.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <climits>
#include <mutex>

namespace amp::detail {

bool keep_cpu_memory() {
  bool changed = false;
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [&changed] {
    changed = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;  // mallopt: 1 on success
    changed = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1 && changed;
  });
#endif
  return changed;
}

}  // namespace amp::detail
