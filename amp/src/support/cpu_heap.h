// SPDX-License-Identifier: BSD-3-Clause
// Private: CPU training reuses its freed memory (Options::keep_cpu_memory).
#pragma once

namespace amp::detail {

// glibc's malloc hands blocks over its mmap threshold back to the kernel
// when they are freed, and trims the heap's free top past its trim
// threshold; the next step's tensors of the same sizes then fault every
// page in again, zeroed by the kernel. This serves blocks up to 32 MiB
// (glibc's largest mmap threshold) from the heap and keeps its freed top
// up to 2 GiB, so a step reuses the pages the last one freed; the process
// keeps up to its peak heap, as LibTorch's CUDA caching allocator keeps
// device memory. Process-wide and once: true from the call that changed
// malloc's settings, false from every other (and where malloc is not
// glibc's, or refused them, as a sanitizer's does).
bool keep_cpu_memory();

}  // namespace amp::detail
