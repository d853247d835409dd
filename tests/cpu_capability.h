// SPDX-License-Identifier: BSD-3-Clause
// Tests of the kernels compiled once per CPU capability
// (optim/one_pass_kernels.h): a suite parameterized over "DEFAULT", "AVX2"
// and "AVX512", each case skipped, with its reason, where this CPU does not
// run the capability's instructions or this build has no kernel for it.
#pragma once

#include "optim/one_pass_kernels.h"

#include <gtest/gtest.h>

#include <string>

namespace amp::testing {

inline bool cpu_runs(const std::string& capability) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (capability == "AVX2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (capability == "AVX512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
#endif
  return capability == "DEFAULT";
}

class CpuCapabilityTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const std::string capability = GetParam();
    if (!cpu_runs(capability)) GTEST_SKIP() << "this CPU does not run " << capability << " instructions";
    if (capability != "DEFAULT" && &detail::one_pass_kernels(capability) == &detail::one_pass_kernels("DEFAULT")) {
      GTEST_SKIP() << "this build has no " << capability << " kernels (not an x86-64 build)";
    }
  }
  const detail::OnePassKernels& kernels() const { return detail::one_pass_kernels(GetParam()); }
};

#define INSTANTIATE_CPU_CAPABILITY_TEST_SUITE(suite)                                                      \
  INSTANTIATE_TEST_SUITE_P(CpuCapabilities, suite, ::testing::Values("DEFAULT", "AVX2", "AVX512"),      \
                           [](const ::testing::TestParamInfo<const char*>& info) { return std::string(info.param); })

}  // namespace amp::testing
