// SPDX-License-Identifier: BSD-3-Clause
#include "optim/one_pass_kernels.h"

#include <ATen/Version.h>

namespace amp::detail {

const OnePassKernels& one_pass_kernels(const std::string& capability) {
#ifdef AMP_CPU_KERNELS_X86
  if (capability == "AVX512") return AVX512::kOnePassKernels;
  if (capability == "AVX2") return AVX2::kOnePassKernels;
#endif
  return DEFAULT::kOnePassKernels;
}

const OnePassKernels& one_pass_kernels() {
  static const OnePassKernels& kernels = one_pass_kernels(at::get_cpu_capability());
  return kernels;
}

}  // namespace amp::detail
