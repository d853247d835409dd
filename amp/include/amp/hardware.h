// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// What this machine's CPU does with amp's low-precision dtypes.
///
/// Mixed precision pays on a CPU only where the CPU has low-precision
/// arithmetic: AVX-512-BF16 or AMX-BF16 for bfloat16 (Intel Xeon since Cooper
/// Lake and Sapphire Rapids, AMD since Zen 4), AVX-512-FP16 or AMX-FP16 for
/// float16. Elsewhere - AVX2-only CPUs: most laptops, many AMD EPYC servers -
/// LibTorch emulates them, and O1 runs several times SLOWER than float32, as
/// Python's torch.autocast does on such a CPU. amp::initialize says so once at
/// verbosity >= 1 when a level computes on the CPU in an emulated dtype;
/// programs read the same facts here:
///
/// ```
///   const amp::CpuPrecision cpu = amp::cpu_precision();
///   if (!cpu.runs_natively(at::kBFloat16)) std::cerr << amp::describe(cpu, at::kBFloat16) << "\n";
/// ```
///
/// Beyond native autocast: table rows whose low-precision kernels exist only
/// in oneDNN for AVX-512 (aten::mkldnn_rnn_layer, behind nn::LSTM/GRU on CPU)
/// run in float32 under amp on CPUs without them, instead of failing with
/// oneDNN's "could not create a primitive descriptor".
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>
#include <set>
#include <string>

namespace amp {

/// What a CPU computes natively, and what oneDNN runs on it.
struct CpuPrecision {
  std::string name;              ///< the CPU's name, e.g. "AMD EPYC"
  bool bf16_arithmetic = false;  ///< AVX-512-BF16 or AMX-BF16
  bool fp16_arithmetic = false;  ///< AVX-512-FP16 or AMX-FP16
  /// oneDNN runs its low-precision primitives (ATen's rule: AVX-512 BW, VL
  /// and DQ, or AVX-NE-CONVERT for bfloat16; AVX-512-FP16 or AVX-NE-CONVERT
  /// for float16).
  ///@{
  bool onednn_bf16 = false;
  bool onednn_fp16 = false;
  ///@}

  /// Whether `dtype` is computed in hardware (float32 and float64 are).
  bool runs_natively(c10::ScalarType dtype) const;
  /// Whether oneDNN's low-precision primitives run `dtype` on this CPU.
  bool onednn_supports(c10::ScalarType dtype) const;
};

/// This machine's CPU, as ATen detects it (at::cpu::get_cpu_capabilities),
/// with the instructions oneDNN is told not to use left out: an
/// ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) below AVX512_CORE_BF16 leaves
/// oneDNN's GEMMs no bfloat16 arithmetic, below AVX512_CORE no low-precision
/// primitives at all (LSTM then runs in float32, as on an AVX2-only CPU).
CpuPrecision cpu_precision();

/// The decision cpu_precision() makes for a CPU named `name` whose ATen
/// capability flags ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16",
/// "avx512_bw", "avx512_vl", "avx512_dq", "avx_ne_convert", ...) are `flags`,
/// with oneDNN capped at `onednn_max_isa` (ONEDNN_MAX_CPU_ISA's value, e.g.
/// "AVX2"; empty, "ALL" or a name oneDNN does not know: no cap).
CpuPrecision cpu_precision_from(const std::string& name, const std::set<std::string>& flags,
                                const std::string& onednn_max_isa = "");

/// One paragraph for users of a CPU that emulates `dtype`: what it costs and
/// the choices. Empty when the CPU computes `dtype` natively.
std::string describe(const CpuPrecision& cpu, c10::ScalarType dtype);

}  // namespace amp
