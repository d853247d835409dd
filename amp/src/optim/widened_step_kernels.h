// SPDX-License-Identifier: BSD-3-Clause
// Private: the widened step's results written back on CUDA by amp's
// kernels, many tensors a launch (compiled where the build has a CUDA
// compiler, which defines AMP_WITH_CUDA_KERNELS): O6's stochastic rounding
// (rounding_kernel.cu) and 8-bit state's coding and decoding
// (state_coding_kernel.cu).
// The ATen ops round a tensor in six launches (its noise by at::randint,
// the add, the mask, the NaNs, the conversion) and code 256 blocks in about
// thirty; a widened step writes back tensor by tensor, slice by slice, so a
// chunk cost hundreds of launches.
//
// The bits are the ATen ops' (stochastic_rounding.h, eight_bit_state.h),
// tested side by side on a GPU: the noise is at::randint's and at::rand's
// draws from the CUDA generator seeded with the stream's seed -
// Philox4x32-10 through cuRAND, each value drawn by the thread, counter and
// lane ATen's distribution kernel would give it for a tensor of that size
// on this device (aten_draws.cuh) - the arithmetic is the ops' float32
// operations one by one, and the conversion is c10's.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace amp::detail {

// One tensor to round: dst (bfloat16) = src (float32, same numel), both
// contiguous on one CUDA device, with the noise of the stream `seed`.
struct CudaRounding {
  at::Tensor src, dst;
  uint64_t seed = 0;
};

// One tensor's values to pack in 8 bits (eight_bit_state.h): values
// (float32, contiguous) into packed (uint8 [ceil(numel / 256), 257],
// contiguous) with the code whose values are `table` (ascending, on the
// device), rounded stochastically with the noise of stream `seed` as
// at::rand draws it for the [rows, 256] padded values, or to nearest
// without one.
struct CudaPacking {
  at::Tensor values, packed, table;
  bool non_negative = false;
  std::optional<uint64_t> seed;
};

// One packed tensor to decode into `values` (float32, contiguous, the
// state's numel) with the code whose values are `table`.
struct CudaUnpacking {
  at::Tensor packed, values, table;
  bool non_negative = false;
};

// One column's piece of a slice that a fused step (adam_on_cuda) steps in
// place: float32; bfloat16, written back rounded stochastically from stream
// `seed` (as round_on_cuda rounds); or packed 8-bit state, written back
// coded stochastically from stream `seed` with the code whose values are
// `table` (as pack_on_cuda codes). Contiguous. Undefined: an empty column.
struct CudaWidePiece {
  at::Tensor t, table;
  uint64_t seed = 0;
  bool non_negative = false;
};

// The options of an Adam or AdamW step, and its overflow flag (float32, one
// element on the slices' device, 1: skip; undefined: none).
struct CudaAdamStep {
  double lr = 0, beta1 = 0, beta2 = 0, weight_decay = 0, eps = 0;
  bool adamw = false, amsgrad = false;
  at::Tensor found_inf;
};

// Whether `t` can be rounded, packed or unpacked by the kernels: the build has amp's CUDA
// kernels, compiled for t's device.
bool widened_step_kernels_apply(const at::Tensor& t);
// Rounds every entry of `roundings` (all on one device, each widened_step_kernels_apply):
// one launch for up to a few dozen tensors. No host sync.
void round_on_cuda(const std::vector<CudaRounding>& roundings);
// Packs every entry of `packings` (as round_on_cuda's): the bytes of
// eight_bit_state.cpp's ATen ops, one block of threads a row.
void pack_on_cuda(const std::vector<CudaPacking>& packings);
// Decodes every entry of `unpackings` (as round_on_cuda's): the values of
// eight_bit_state.cpp's ATen ops. A code the table has not (damaged state,
// which the CPU refuses) decodes as NaN: the kernel cannot raise an error
// without the host waiting for it.
void unpack_on_cuda(const std::vector<CudaUnpacking>& unpackings);

// Steps `slices` (all on one device, each widened_step_kernels_apply), each
// [param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (undefined without
// amsgrad), its parameter's device step count (float32, one element, this
// step's included)], by ATen's fused Adam / AdamW arithmetic in one launch
// for up to about 90 slices: each value decoded, stepped in float32 and
// written back as the chunked path writes it - the bits of widening each piece,
// at::_fused_adam(w)_ over them, then round_on_cuda and pack_on_cuda,
// without the float32 copies or their launches. The gradient is only read.
void adam_on_cuda(const std::vector<std::vector<CudaWidePiece>>& slices, const CudaAdamStep& step);

// The options of an SGD step, as CudaAdamStep's; `first_step`: the
// momentum buffers are new (set to the gradient).
struct CudaSgdStep {
  double lr = 0, weight_decay = 0, momentum = 0, dampening = 0;
  bool nesterov = false, first_step = false;
  at::Tensor found_inf;
};
// Steps `slices`, each [param, grad, momentum_buffer (undefined without
// momentum)], by ATen's fused SGD arithmetic, as adam_on_cuda steps Adam's.
void sgd_on_cuda(const std::vector<std::vector<CudaWidePiece>>& slices, const CudaSgdStep& step);

// Whether widened steps run through the fused kernels where they can (the
// default), or always as the chunked path: widened copies, ATen's fused
// kernel, then rounded and packed - the reference the fused kernels are
// tested and measured against.
void set_widened_steps_fused(bool fused);
bool widened_steps_fused();

}  // namespace amp::detail
