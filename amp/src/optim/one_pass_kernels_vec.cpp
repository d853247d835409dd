// SPDX-License-Identifier: BSD-3-Clause
// Compiled once per CPU capability (CPU_CAPABILITY: DEFAULT, AVX2, AVX512;
// one_pass_kernels.h). The arithmetic is the ATen ops' of
// stochastic_rounding.cpp and eight_bit_state.cpp, in float32, value by
// value in the same order: the same bits.
#include "optim/one_pass_kernels.h"

#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

namespace amp::detail::CPU_CAPABILITY {
namespace {

using Floats = at::vec::Vectorized<float>;
using Ints = at::vec::Vectorized<int32_t>;
constexpr int64_t kBlock = 256, kRow = kBlock + 1;
constexpr int kMinExponent = -126, kMaxExponent = 127, kNonFiniteBlock = -128;
static_assert(kBlock % Floats::size() == 0 && Floats::size() == Ints::size());

Ints as_ints(const Floats& v) { return at::vec::cast<int32_t>(v); }
Floats as_floats(const Ints& v) { return at::vec::cast<float>(v); }
Floats where(const Floats& mask, const Floats& then, const Floats& otherwise) {
  return Floats::blendv(otherwise, then, mask);
}
Ints where(const Ints& mask, const Ints& then, const Ints& otherwise) { return Ints::blendv(otherwise, then, mask); }
Floats gather(const float* table, const Ints& index) { return at::vec::gather<sizeof(float)>(table, index); }

// Philox4x32-10 (one_pass_kernels.h): the draws of counters
// [first_counter, first_counter + counters), four each, into `out`. A
// plain loop over the counters, its rounds unrolled.
void philox_draws_serial(uint64_t seed, int64_t first_counter, int64_t counters, uint32_t* __restrict out) {
  const uint32_t key0 = static_cast<uint32_t>(seed), key1 = static_cast<uint32_t>(seed >> 32);
  for (int64_t j = 0; j < counters; ++j) {
    const uint64_t counter = static_cast<uint64_t>(first_counter + j);
    uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = key0, k1 = key1;
#pragma GCC unroll 10
    for (int round = 0; round < 10; ++round) {
      const uint64_t p0 = uint64_t{0xD2511F53u} * c0, p1 = uint64_t{0xCD9E8D57u} * c2;
      c0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
      c1 = static_cast<uint32_t>(p1);
      c2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
      c3 = static_cast<uint32_t>(p0);
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    out[4 * j] = c0;
    out[4 * j + 1] = c1;
    out[4 * j + 2] = c2;
    out[4 * j + 3] = c3;
  }
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// The same rounds a vector register of counters at a time (one counter a
// 32-bit lane): the compiler cannot see that a 32 x 32 -> 64-bit product's
// halves are two instructions' lanes, so they are written out here.
#if defined(CPU_CAPABILITY_AVX512)
using Words = __m512i;
constexpr int64_t kLanes = 16;
Words splat(uint32_t v) { return _mm512_set1_epi32(static_cast<int32_t>(v)); }
Words lane_index() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
Words add(Words a, Words b) { return _mm512_add_epi32(a, b); }
Words exclusive_or(Words a, Words b) { return _mm512_xor_si512(a, b); }
Words low_product(Words a, Words m) { return _mm512_mullo_epi32(a, m); }
// The high halves of a * m (m the same in every lane): even lanes' products
// moved down, odd lanes' in place.
Words high_product(Words a, Words m) {
  return _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(_mm512_mul_epu32(a, m), 32),
                                 _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m));
}
// Lane j of c0..c3 to out[4 j .. 4 j + 3].
void store_interleaved(Words c0, Words c1, Words c2, Words c3, uint32_t* out) {
  const Words t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
  const Words t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
  // u_k's 128-bit lanes hold counters k, k + 4, k + 8, k + 12.
  const Words u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);
  const Words u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);
  const Words v0 = _mm512_shuffle_i32x4(u0, u1, 0x44), v1 = _mm512_shuffle_i32x4(u2, u3, 0x44);  // 0 4 1 5, 2 6 3 7
  const Words v2 = _mm512_shuffle_i32x4(u0, u1, 0xEE), v3 = _mm512_shuffle_i32x4(u2, u3, 0xEE);  // 8 12 9 13, ...
  _mm512_storeu_si512(out, _mm512_shuffle_i32x4(v0, v1, 0x88));
  _mm512_storeu_si512(out + 16, _mm512_shuffle_i32x4(v0, v1, 0xDD));
  _mm512_storeu_si512(out + 32, _mm512_shuffle_i32x4(v2, v3, 0x88));
  _mm512_storeu_si512(out + 48, _mm512_shuffle_i32x4(v2, v3, 0xDD));
}
#else
using Words = __m256i;
constexpr int64_t kLanes = 8;
Words splat(uint32_t v) { return _mm256_set1_epi32(static_cast<int32_t>(v)); }
Words lane_index() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
Words add(Words a, Words b) { return _mm256_add_epi32(a, b); }
Words exclusive_or(Words a, Words b) { return _mm256_xor_si256(a, b); }
Words low_product(Words a, Words m) { return _mm256_mullo_epi32(a, m); }
Words high_product(Words a, Words m) {
  return _mm256_blend_epi32(_mm256_srli_epi64(_mm256_mul_epu32(a, m), 32),
                            _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m), 0xAA);
}
void store_interleaved(Words c0, Words c1, Words c2, Words c3, uint32_t* out) {
  const Words t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
  const Words t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
  // u_k's 128-bit halves hold counters k and k + 4.
  const Words u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const Words u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  auto* words = reinterpret_cast<__m256i*>(out);
  _mm256_storeu_si256(words, _mm256_permute2x128_si256(u0, u1, 0x20));
  _mm256_storeu_si256(words + 1, _mm256_permute2x128_si256(u2, u3, 0x20));
  _mm256_storeu_si256(words + 2, _mm256_permute2x128_si256(u0, u1, 0x31));
  _mm256_storeu_si256(words + 3, _mm256_permute2x128_si256(u2, u3, 0x31));
}
#endif

void philox_draws(uint64_t seed, int64_t first_counter, int64_t counters, uint32_t* __restrict out) {
  const uint64_t first = static_cast<uint64_t>(first_counter);
  int64_t j = 0;
  // Lanes add to the counter's low word; a run that would carry into the
  // high word is left to the serial loop.
  if (((first + static_cast<uint64_t>(counters)) >> 32) == (first >> 32)) {
    Words k0[10], k1[10];
    for (int round = 0; round < 10; ++round) {
      k0[round] = splat(static_cast<uint32_t>(seed) + 0x9E3779B9u * static_cast<uint32_t>(round));
      k1[round] = splat(static_cast<uint32_t>(seed >> 32) + 0xBB67AE85u * static_cast<uint32_t>(round));
    }
    const Words m0 = splat(0xD2511F53u), m1 = splat(0xCD9E8D57u), zero = splat(0);
    const Words high = splat(static_cast<uint32_t>(first >> 32)), lanes = lane_index();
    for (; j + kLanes <= counters; j += kLanes) {
      Words c0 = add(splat(static_cast<uint32_t>(first + j)), lanes), c1 = high, c2 = zero, c3 = zero;
#pragma GCC unroll 10
      for (int round = 0; round < 10; ++round) {
        const Words next0 = exclusive_or(exclusive_or(high_product(c2, m1), c1), k0[round]);
        const Words next2 = exclusive_or(exclusive_or(high_product(c0, m0), c3), k1[round]);
        c1 = low_product(c2, m1);
        c3 = low_product(c0, m0);
        c0 = next0;
        c2 = next2;
      }
      store_interleaved(c0, c1, c2, c3, out + 4 * j);
    }
  }
  philox_draws_serial(seed, first_counter + j, counters - j, out + 4 * j);
}
#else
void philox_draws(uint64_t seed, int64_t first_counter, int64_t counters, uint32_t* __restrict out) {
  philox_draws_serial(seed, first_counter, counters, out);
}
#endif

// log2(1 + m) ~ m (c0 + m (c1 + m c2)) over m in [0, 1): within 0.0014
// (least squares), so a code guessed from it is within 0.011 of k(y).
constexpr float kLog2Fit[3] = {1.4234952f, -0.5877732f, 0.1655934f};
// The guess's margin: larger than the fit's error in codes (0.011) and a
// code's float32 rounding (1e-6), smaller than one code less both.
constexpr float kGuessMargin = 0.05f;

// One block: `x` its 256 values (zeros past the tensor's end).
void code_block(const CodeTable& t, const float* x, const uint32_t* draws, uint8_t* row) {
  // The largest magnitude as bits (ordered as the values are); an inf or
  // NaN is above every finite one.
  Ints max_bits(0);
  for (int64_t i = 0; i < kBlock; i += Floats::size()) {
    max_bits = at::vec::maximum(max_bits, as_ints(Floats::loadu(x + i)) & Ints(0x7FFFFFFF));
  }
  std::array<int32_t, Ints::size()> lanes;
  max_bits.store(lanes.data());
  const int32_t max_magnitude = *std::max_element(lanes.begin(), lanes.end());
  if (max_magnitude >= 0x7F800000) {  // no scale: codes 0, the exponent byte kNonFiniteBlock
    std::fill_n(row, kBlock, uint8_t{0});
    row[kBlock] = static_cast<uint8_t>(static_cast<int8_t>(kNonFiniteBlock));
    return;
  }
  float max;
  std::memcpy(&max, &max_magnitude, sizeof max);
  int exponent = 0;
  const float mantissa = std::frexp(max, &exponent);
  int e = std::clamp(exponent - (mantissa == 0.5f ? 1 : 0), kMinExponent, kMaxExponent);
  // x / 2^e as x * 2^-e: the same real value, rounded once either way.
  const Floats inverse_scale(std::ldexp(1.0f, -e));

  const Floats low(t.non_negative ? 0.0f : -1.0f), one(1.0f), zero_value(0.0f);
  const Floats steps(static_cast<float>(t.steps)), margin(kGuessMargin);
  const Ints last(t.last), zero(t.zero), below_zero(t.zero - 1), ones(1), twos(2), none(0);
  std::array<int32_t, kBlock> codes;
  Ints chosen_max(0);
  for (int64_t i = 0; i < kBlock; i += Floats::size()) {
    // y = min(max(x / scale, low), 1), as std::max and std::min compare.
    Floats y = Floats::loadu(x + i) * inverse_scale;
    y = where(y < low, low, y);
    y = where(one < y, one, y);
    // The largest code <= y (code k's magnitude 2^(-k / steps)): guessed
    // from y's binary logarithm within 0.0014, in codes k = -log2|y| * steps
    // within 0.011, then moved off by kGuessMargin so that the guess is
    // the code or the one below it - whatever the table's float32 rounding
    // of a code near y. One comparison with the next code settles it.
    const Ints magnitude = as_ints(y) & Ints(0x7FFFFFFF);
    const Floats m = as_floats((magnitude & Ints(0x7FFFFF)) | Ints(0x3F800000)) - one;  // mantissa - 1, exactly
    const Floats log2 =
        at::vec::convert_to_fp_of_same_size<float>(((magnitude >> Ints(23)) & Ints(0xFF)) - Ints(127)) +
        m * (Floats(kLog2Fit[0]) + m * (Floats(kLog2Fit[1]) + m * Floats(kLog2Fit[2])));
    const Floats k = log2.neg() * steps;
    // Above 0 the code of the smallest k >= k(y), below 0 of the largest
    // k <= k(y): rounded away from y's code by the margin, never past it.
    const Ints above = at::vec::maximum(last - at::vec::convert_to_int_of_same_size((k + margin).ceil()), zero);
    const Ints below = at::vec::minimum(
        at::vec::convert_to_int_of_same_size(at::vec::maximum(k - margin, zero_value)), below_zero);
    const Ints guess = where(as_ints(y < zero_value), below, where(as_ints(y > zero_value), above, zero));
    const Floats g0 = gather(t.values, guess), g1 = gather(t.values, at::vec::minimum(guess + ones, last)),
                 g2 = gather(t.values, at::vec::minimum(guess + twos, last));
    const Ints step_up = (guess < last) & as_ints(g1 <= y);
    const Ints lo = guess - step_up;
    const Floats a = where(as_floats(step_up), g1, g0), b = where(as_floats(step_up), g2, g1);
    // Between its codes a <= y <= b: up with probability (y - a) / (b - a).
    Floats up;
    if (draws != nullptr) {
      const Ints draw = Ints::loadu(draws + i) & Ints(0xFFFFFF);
      up = at::vec::convert_to_fp_of_same_size<float>(draw) * Floats(0x1p-24f) * (b - a) < (y - a);
    } else {
      up = (y - a) > (b - y);
    }
    (lo - as_ints(up)).store(codes.data() + i);
    chosen_max = at::vec::maximum(chosen_max, as_ints(where(up, b, a)) & Ints(0x7FFFFFFF));
  }
  // A block whose largest chosen code is 0.5 is coded one exponent down.
  chosen_max.store(lanes.data());
  const bool halve = *std::max_element(lanes.begin(), lanes.end()) == 0x3F000000 && e > kMinExponent;
  if (halve) {
    for (int32_t& c : codes) {
      c += t.non_negative ? (c > 0) * t.steps : ((c > t.zero) - (c < t.zero)) * t.steps;
    }
    e -= 1;
  }
  std::copy(codes.begin(), codes.end(), row);
  row[kBlock] = static_cast<uint8_t>(static_cast<int8_t>(e));
}

void code_blocks(const CodeTable& table, const float* values, int64_t numel, int64_t first_block, int64_t blocks,
                 const uint64_t* seed, uint8_t* rows) {
  std::array<float, kBlock> padded;
  alignas(64) std::array<uint32_t, kBlock> draws;
  for (int64_t block = first_block; block < first_block + blocks; ++block) {
    const int64_t first = block * kBlock, count = std::min(kBlock, numel - first);
    const float* x = values + first;
    if (count < kBlock) {
      std::fill(std::copy_n(x, count, padded.begin()), padded.end(), 0.0f);
      x = padded.data();
    }
    if (seed != nullptr) philox_draws(*seed, first / 4, kBlock / 4, draws.data());
    code_block(table, x, seed != nullptr ? draws.data() : nullptr, rows + block * kRow);
  }
}

void round_to_bfloat16(const uint32_t* src, uint16_t* dst, int64_t first, int64_t count, uint64_t seed) {
  constexpr int64_t kValues = 2048;  // a chunk's draws: 16 bits a value, 2 a draw, 8 a counter
  constexpr uint32_t kSignBit = 0x80000000u, kExponentBits = 0x7F800000u, kKeptBits = 0xFFFF0000u;
  alignas(64) std::array<uint32_t, kValues / 2> draws;
  const auto* noise = reinterpret_cast<const uint16_t*>(draws.data());
  for (int64_t done = 0; done < count; done += kValues) {
    const int64_t n = std::min(kValues, count - done);
    philox_draws(seed, (first + done) / 8, (n + 7) / 8, draws.data());
    const uint32_t* __restrict in = src + first + done;
    uint16_t* __restrict out = dst + first + done;
    for (int64_t i = 0; i < n; ++i) {
      // A NaN's bits plus noise may carry into inf, or past the sign into a small number.
      const bool nan = (in[i] & ~kSignBit) > kExponentBits;
      const uint32_t bits = (in[i] + noise[i]) & kKeptBits;
      out[i] = nan ? uint16_t{0x7FC0} : static_cast<uint16_t>(bits >> 16);
    }
  }
}

// Ints::size() codes from `codes`, widened.
Ints load_codes(const uint8_t* codes) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return at::vec::convert_to_int32<uint8_t>(codes);
#else
  std::array<int32_t, Ints::size()> wide;
  std::copy_n(codes, wide.size(), wide.begin());
  return Ints::loadu(wide.data());
#endif
}

int64_t decode_blocks(const CodeTable& t, const uint8_t* rows, int64_t numel, int64_t first_block, int64_t blocks,
                      float* values) {
  for (int64_t block = first_block; block < first_block + blocks; ++block) {
    const uint8_t* row = rows + block * kRow;
    const int64_t first = block * kBlock, count = std::min(kBlock, numel - first);
    uint8_t max_code = 0;
    for (int64_t i = 0; i < count; ++i) max_code = std::max(max_code, row[i]);
    if (max_code > t.last) return first + (std::find_if(row, row + count, [&](uint8_t c) { return c > t.last; }) - row);
    const int e = static_cast<int8_t>(row[kBlock]);
    const float scale = e == kNonFiniteBlock ? std::numeric_limits<float>::quiet_NaN()
                                             : std::ldexp(1.0f, std::max(e, kMinExponent));
    float* out = values + first;
    int64_t i = 0;
    for (; i + Ints::size() <= count; i += Ints::size()) {
      (gather(t.values, load_codes(row + i)) * Floats(scale)).store(out + i);
    }
    for (; i < count; ++i) out[i] = t.values[row[i]] * scale;
  }
  return -1;
}

void widen_bfloat16(const uint16_t* __restrict src, uint32_t* __restrict dst, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = uint32_t{src[i]} << 16;
}

}  // namespace

const OnePassKernels kOnePassKernels{&code_blocks, &decode_blocks, &round_to_bfloat16, &widen_bfloat16};

}  // namespace amp::detail::CPU_CAPABILITY
