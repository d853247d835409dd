// SPDX-License-Identifier: BSD-3-Clause
// Private: optimizer state kept in 8 bits a value
// (Properties::optimizer_state_dtype = uint8), as bitsandbytes' and
// torchao's 8-bit optimizers keep it: blockwise, each block of 256 values
// scaled by its own absolute maximum and coded in one byte each.
//
// Layout (one uint8 tensor per state tensor, so LibTorch's state classes,
// torch::save and amp's checkpoints carry it unchanged): [blocks, 257],
// blocks = ceil(numel / 256); a row is a block's 256 codes (the last
// block padded with zeros), then the block's scale as a signed power-of-two
// exponent (int8). 257 bytes per 256 values: Adam's two moments take 2.01
// bytes a parameter, against 8 in float32.
//
// A value is code_value[code] * 2^exponent. The exponent is the smallest
// whose power of two holds the block's absolute maximum, so scaling and
// unscaling are exact and a block read and packed again is the same bytes
// (a step skipped on the device, a checkpoint split over ranks and joined
// again). The codes are logarithmic, so small values keep their relative
// precision beside a large one in their block:
//   - signed (Adam's first moment, SGD's momentum): 0 and +-2^(-k/8),
//     k = 0..126 (9% apart, down to 2^-15.75 of the block's maximum);
//   - non-negative (Adam's second moment): 0 and 2^(-k/4), k = 0..254
//     (down to 2^-63.5: the square root, which divides the update, keeps
//     the signed code's precision and twice its range, so a small
//     gradient's second moment beside a large one is not coded as 0).
//
// A block holding an inf or NaN (a moment that overflowed float32, a NaN
// gradient under a static loss scale, which never skips) has no scale: its
// exponent byte is -128 (below every scale's) and its codes 0, and it
// unpacks as NaN in all 256 values - never as finite values, so the step
// that reads it is not finite either, as with float32 state (where only
// the value itself would be). A dynamic scale skips the steps whose
// gradients are not finite before any moment is updated.
//
// Packing rounds each value to one of its two neighbouring codes with
// probabilities that make the expected code value the value itself
// (stochastic rounding): Adam's second moment moves 0.1% a step with
// beta2 = 0.999, far less than a code's step, so rounding to nearest would
// freeze it. The noise comes from amp's rounding streams
// (stochastic_rounding.h): runs are reproducible and resume bit for bit.
#pragma once

#include "optim/one_pass_kernels.h"
#include "optim/stochastic_rounding.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace amp::detail {

inline constexpr int64_t kStateBlock = 256;
inline constexpr int64_t kPackedRow = kStateBlock + 1;  // codes, then the exponent

// Whether `state` is packed 8-bit state (uint8 [blocks, 257]).
bool is_packed_state(const at::Tensor& state);
// Whether `state` is the packed form of `param`'s values: contiguous, on
// its device, with ceil(numel / 256) blocks.
bool packs(const at::Tensor& state, const at::Tensor& param);
// The packed form's rows for `numel` values.
int64_t packed_blocks(int64_t numel);
// The values of the signed or non-negative code, ascending (float32), on
// `device`: made once per device.
const at::Tensor& code_values(bool non_negative, c10::Device device);

// The packed form of `values` (float32, any shape). Rounded stochastically
// with `rounder`'s stream `key`; to nearest without one (converting loaded
// state). On the CPU each block is coded in one pass (`path`,
// stochastic_rounding.h), on CUDA by amp's kernel where the build has it
// (widened_step_kernels.h): the same bytes as the ATen ops.
at::Tensor pack_state(const at::Tensor& values, bool non_negative, StochasticRounding* rounder,
                      RoundingKey key = {}, CpuPath path = CpuPath::kOnePass);
// Packs `values` (float32, numel of the state's values) into `packed`.
void pack_state_into(const at::Tensor& values, const at::Tensor& packed, bool non_negative,
                     StochasticRounding* rounder, RoundingKey key = {}, CpuPath path = CpuPath::kOnePass);
// One packing of pack_states_into.
struct StatePacking {
  at::Tensor values, packed;
  bool non_negative = false;
  RoundingKey key;
};
// Each of `packings` as pack_state_into packs it, rounded with `rounder`'s
// streams; on CUDA those amp's kernels take (widened_step_kernels.h) many
// tensors a launch.
void pack_states_into(const std::vector<StatePacking>& packings, StochasticRounding* rounder);
// pack_state_into's one-pass path on the CPU by `kernel`
// (one_pass_kernels.h: one per CPU capability) rather than the one ATen
// runs with: the tests compare each that the CPU runs with the ATen ops.
void pack_state_into_by(CodeBlocksFn kernel, const at::Tensor& values, const at::Tensor& packed, bool non_negative,
                        StochasticRounding* rounder, RoundingKey key = {});
// The packed form of `numel` zeros (pack_state's bytes), made without
// float32 values of that size.
at::Tensor packed_zeros(int64_t numel, bool non_negative, const at::TensorOptions& options);
// The float32 values of `packed`, shaped `sizes`.
at::Tensor unpack_state(const at::Tensor& packed, at::IntArrayRef sizes, bool non_negative,
                        CpuPath path = CpuPath::kOnePass);
// The same values written into `values` (float32, on packed's device,
// numel of the state's values): no allocation of its own. On CUDA by amp's
// kernel where the build has it, which decodes a damaged code as NaN.
void unpack_state_into(const at::Tensor& packed, const at::Tensor& values, bool non_negative,
                       CpuPath path = CpuPath::kOnePass);

// One decoding of unpack_states_into.
struct StateUnpacking {
  at::Tensor packed, values;
  bool non_negative = false;
};
// Each of `unpackings` as unpack_state_into decodes it; on CUDA those
// amp's kernels take (widened_step_kernels.h) many tensors a launch.
void unpack_states_into(const std::vector<StateUnpacking>& unpackings);

// unpack_state_into's one-pass path on the CPU by `kernel`, as
// pack_state_into_by.
void unpack_state_into_by(DecodeBlocksFn kernel, const at::Tensor& packed, const at::Tensor& values, bool non_negative);

// A state tensor's values in its parameter's shape: packed state unpacked
// to float32, any other as it is.
at::Tensor state_values(const at::Tensor& state, const at::Tensor& param, bool non_negative);
// `values` kept as `dtype` in a tensor of their own: uint8 packs them (to
// nearest), another dtype casts them.
at::Tensor state_kept_as(const at::Tensor& values, at::ScalarType dtype, bool non_negative);

}  // namespace amp::detail
