// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Layers whose matrix-multiply dimensions miss the sizes the hardware
/// computes fastest: the tutorials' "keep dimensions multiples of 8 so
/// tensor cores are used; pad if necessary", as a check over a model.
/// tools/precision_report prints it; not included by amp.h.
///
/// ```
///   for (const amp::MisalignedLayer& l : amp::misaligned_layers(*model, at::kHalf, torch::kCUDA))
///     std::cout << l.module << " " << l.dimension << " " << l.size << " -> " << l.padded << "\n";
/// ```
///
/// The preferred multiple (preferred_multiple):
/// ```
///   CUDA, float16/bfloat16   8   tensor cores take 16-byte rows (cuBLAS, cuDNN)
///   CUDA, float8            16   the float8 GEMMs need multiples of 16
///   CPU with bfloat16/float16 arithmetic (AVX-512-BF16/FP16, AMX)
///                           16   one AVX-512 register, one AMX tile row, holds
///                                16 float32 results
///   otherwise                0   no preference: the CPU converts rather than
///                                computes the dtype (hardware.h), float32
/// ```
/// Checked: the input and output features of nn::Linear, the input channels
/// per group and the output channels of nn::Conv1d/2d/3d and
/// nn::ConvTranspose1d/2d/3d (the implicit GEMM's K and N). The batch and
/// sequence sizes (the GEMM's M) come from the data and are not checked.
#pragma once

#include <amp/hardware.h>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

namespace amp {

/// One checked dimension of a layer that is not a multiple of the preferred
/// multiple.
struct MisalignedLayer {
  std::string module;     ///< its path in the model: "blocks.0.fc1" ("" for the model itself)
  std::string kind;       ///< "Linear", "Conv2d", ...
  std::string dimension;  ///< "in_features", "out_features", "in_channels per group", "out_channels"
  int64_t size = 0;       ///< e.g. 50257
  int64_t padded = 0;     ///< the next multiple, e.g. 50264
};

/// 0 where `device` has no preference for `dtype`; `cpu` describes the CPU
/// (cpu_precision() by default).
int64_t preferred_multiple(c10::ScalarType dtype, c10::Device device, const CpuPrecision& cpu = cpu_precision());

/// Every checked dimension of `model`'s layers that is not a multiple of
/// preferred_multiple(dtype, device, cpu), in module order; empty where there
/// is no preference.
std::vector<MisalignedLayer> misaligned_layers(const torch::nn::Module& model, c10::ScalarType dtype,
                                               c10::Device device, const CpuPrecision& cpu = cpu_precision());

/// The layers as a Markdown table, or one line saying there are none.
std::string format_misaligned_layers(const std::vector<MisalignedLayer>& layers, int64_t multiple);

}  // namespace amp
