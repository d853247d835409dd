#include "support/cpu_heap.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <climits>
#include <mutex>

namespace amp::detail {

void keep_cpu_memory() {
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, INT_MAX);
  });
#endif
}

}  // namespace amp::detail
