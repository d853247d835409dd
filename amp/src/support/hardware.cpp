// SPDX-License-Identifier: BSD-3-Clause
#include <amp/hardware.h>
#include <amp/testing.h>

#include <ATen/cpu/Utils.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>

namespace amp {
namespace {

std::mutex g_override_mutex;
std::optional<CpuPrecision> g_override;

// oneDNN's ISA names (ONEDNN_MAX_CPU_ISA), in order, with their aliases.
int isa_rank(std::string isa) {
  std::transform(isa.begin(), isa.end(), isa.begin(), [](unsigned char c) { return std::toupper(c); });
  static const std::map<std::string, int> ranks = {
      {"SSE41", 0}, {"AVX", 1}, {"AVX2", 2}, {"AVX2_VNNI", 3}, {"AVX2_VNNI_2", 4}, {"AVX512_CORE", 5},
      {"AVX512_CORE_VNNI", 6}, {"AVX512_CORE_BF16", 7}, {"AVX512_CORE_FP16", 8}, {"AVX10_1_512", 8},
      {"AVX512_CORE_AMX", 9}, {"AVX10_1_512_AMX", 9}, {"AVX512_CORE_AMX_FP16", 10}, {"AVX10_1_512_AMX_FP16", 10}};
  const auto it = ranks.find(isa);
  return it == ranks.end() ? std::numeric_limits<int>::max() : it->second;
}

// The least oneDNN ISA that uses each flag amp reads.
const std::map<std::string, int>& flag_isa() {
  static const std::map<std::string, int> ranks = {
      {"avx_ne_convert", 4}, {"avx512_bw", 5}, {"avx512_vl", 5}, {"avx512_dq", 5}, {"avx512_bf16", 7},
      {"avx512_fp16", 8}, {"amx_bf16", 9}, {"amx_tile", 9}, {"amx_fp16", 10}};
  return ranks;
}

CpuPrecision detect() {
  std::string name;
  std::set<std::string> flags;
  for (const auto& [key, value] : at::cpu::get_cpu_capabilities()) {
    if (key == "cpu_name" && value.isString()) name = value.toStringRef();
    if (value.isBool() && value.toBool()) flags.insert(key);
  }
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (cap == nullptr) cap = std::getenv("DNNL_MAX_CPU_ISA");
  return cpu_precision_from(name, flags, cap ? cap : "");
}

}  // namespace

CpuPrecision cpu_precision_from(const std::string& name, const std::set<std::string>& flags,
                                const std::string& onednn_max_isa) {
  const int cap = isa_rank(onednn_max_isa);
  auto has = [&](const char* flag) {
    const auto needs = flag_isa().find(flag);
    return flags.count(flag) != 0 && (needs == flag_isa().end() || needs->second <= cap);
  };
  CpuPrecision cpu;
  cpu.name = name;
  cpu.bf16_arithmetic = has("avx512_bf16") || has("amx_bf16");
  cpu.fp16_arithmetic = has("avx512_fp16") || has("amx_fp16");
  const bool avx512_core = has("avx512_bw") && has("avx512_vl") && has("avx512_dq");
  cpu.onednn_bf16 = avx512_core || has("avx_ne_convert");
  cpu.onednn_fp16 = has("avx512_fp16") || has("avx_ne_convert");
  return cpu;
}

bool CpuPrecision::runs_natively(c10::ScalarType dtype) const {
  if (dtype == c10::kBFloat16) return bf16_arithmetic;
  if (dtype == c10::kHalf) return fp16_arithmetic;
  return true;
}

bool CpuPrecision::onednn_supports(c10::ScalarType dtype) const {
  if (dtype == c10::kBFloat16) return onednn_bf16;
  if (dtype == c10::kHalf) return onednn_fp16;
  return true;
}

CpuPrecision cpu_precision() {
  {
    std::lock_guard<std::mutex> lock(g_override_mutex);
    if (g_override) return *g_override;
  }
  static const CpuPrecision detected = detect();
  return detected;
}

std::string describe(const CpuPrecision& cpu, c10::ScalarType dtype) {
  if (cpu.runs_natively(dtype)) return {};
  const bool bf16 = dtype == c10::kBFloat16;
  const std::string name = cpu.name.empty() ? "this CPU" : "this CPU (" + cpu.name + ")";
  return name + " has no " + c10::toString(dtype) + " arithmetic (" +
         (bf16 ? "AVX-512-BF16 or AMX-BF16" : "AVX-512-FP16 or AMX-FP16") +
         "), so LibTorch emulates it: mixed precision on this CPU runs several times slower than "
         "float32 (measured on a 2-core AVX2 AMD EPYC at O1: 6x for a CNN, 10x for a small "
         "transformer), as Python's "
         "torch.autocast does here. Choices: opt_level O0 for speed on this machine; a GPU, or "
         "a CPU with " + (bf16 ? "AVX-512-BF16/AMX" : "AVX-512-FP16/AMX-FP16") +
         ", for mixed-precision speed; or keep going for about half the activation memory.";
}

void set_cpu_precision_for_testing(std::optional<CpuPrecision> cpu) {
  std::lock_guard<std::mutex> lock(g_override_mutex);
  g_override = std::move(cpu);
}

}  // namespace amp
