// SPDX-License-Identifier: BSD-3-Clause
// Private: the widened step's CPU kernels, in one vectorized pass over the
// values - O6's stochastic rounding into bfloat16 (stochastic_rounding.h),
// 8-bit state's block coding (eight_bit_state.h), and the widening of
// bfloat16 values into the step's float32 buffer (fused_stepping.cpp).
//
// one_pass_kernels_vec.cpp is compiled once per CPU capability ATen knows
// (DEFAULT everywhere; AVX2 and AVX512 on x86-64), each with that
// capability's flags and at::vec, as ATen compiles its own kernels; the
// callers take the set for the capability ATen runs with
// (at::get_cpu_capability(): ATEN_CPU_CAPABILITY selects it too). Every
// kernel writes the bytes of the ATen ops that the other devices run, from
// the same draws.
//
// The draws are Philox4x32-10's (Salmon et al., SC'11; ATen's
// at::philox_engine): draw i of the stream seeded `seed` is output i % 4 of
// the block at counter i / 4 (key: the seed's two halves). Any range of
// them is computed where it is used, so the values are coded or rounded in
// parallel and in vector registers, and a stream costs nothing to seed.
#pragma once

#include <cstdint>
#include <string>

namespace amp::detail {

// A code table and what codes against it: its values ascending (float32),
// the last index, the index of 0, and the codes per octave (a code's value
// is 2^(-k / steps)).
struct CodeTable {
  const float* values;
  int last, zero;
  int steps;
  bool non_negative;
};

// Codes blocks [first_block, first_block + blocks) of `values` (numel
// float32; the last block padded with zeros) into their rows of `rows`
// (257 bytes each, eight_bit_state.h). `seed`: the stream whose draw i is
// value i's noise (at::rand's float of it), or null to round to nearest.
using CodeBlocksFn = void (*)(const CodeTable& table, const float* values, int64_t numel, int64_t first_block,
                              int64_t blocks, const uint64_t* seed, uint8_t* rows);
// Decodes blocks [first_block, first_block + blocks) of `rows` into their
// values of `values` (numel float32): a code's table value times the
// block's 2^e (NaN for a block of a non-finite value). Returns the index of
// the first value whose code is past the table's last (damaged state;
// the blocks before it are decoded), or -1.
using DecodeBlocksFn = int64_t (*)(const CodeTable& table, const uint8_t* rows, int64_t numel, int64_t first_block,
                                   int64_t blocks, float* values);
// dst[i] = src[i] (float32 bits) rounded stochastically into bfloat16 bits
// for i in [first, first + count), first a multiple of 8: the bits plus
// 16 random bits, cut to bfloat16's; a NaN as bfloat16's canonical NaN. The
// 16 bits are half of a draw: value i's are the uint16 at i in the
// stream's draws' memory (so draw i / 2 gives values i and i + 1 theirs).
using RoundFn = void (*)(const uint32_t* src, uint16_t* dst, int64_t first, int64_t count, uint64_t seed);

// dst[i] = src[i] (bfloat16 bits) as float32 bits, for i in [0, count):
// exact, as ATen's conversion (a NaN keeps its payload).
using WidenFn = void (*)(const uint16_t* src, uint32_t* dst, int64_t count);

struct OnePassKernels {
  CodeBlocksFn code_blocks;
  DecodeBlocksFn decode_blocks;
  RoundFn round_to_bfloat16;
  WidenFn widen_bfloat16;
};

namespace DEFAULT {
extern const OnePassKernels kOnePassKernels;
}
namespace AVX2 {
extern const OnePassKernels kOnePassKernels;
}
namespace AVX512 {
extern const OnePassKernels kOnePassKernels;
}

// The kernels for `capability` (at::get_cpu_capability()'s name: "DEFAULT",
// "AVX2", "AVX512"), or for the best one below it that this build has.
const OnePassKernels& one_pass_kernels(const std::string& capability);
// Those for the capability ATen runs with.
const OnePassKernels& one_pass_kernels();

}  // namespace amp::detail
