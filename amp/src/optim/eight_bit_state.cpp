// SPDX-License-Identifier: BSD-3-Clause
#include "optim/eight_bit_state.h"

#include "optim/stochastic_rounding.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

namespace amp::detail {
namespace {

// Code k's magnitude is 2^(-k / kSteps); doubling a value moves its code by
// kSteps (a block re-coded one exponent down).
constexpr int64_t kSignedSteps = 8, kNonNegativeSteps = 4;
constexpr int64_t kSignedZero = 127;  // the signed table's index of 0
constexpr int kMinExponent = -126, kMaxExponent = 127;  // 2^e a normal float32
// The exponent byte of a block holding an inf or NaN (below every scale's).
constexpr int kNonFiniteBlock = -128;

// The code values in ascending order (float32): signed -1 .. 0 .. 1 (255
// values), non-negative 0 .. 1 (256).
at::Tensor make_code_values(bool non_negative) {
  const int64_t count = non_negative ? 255 : 127;
  const double steps = non_negative ? kNonNegativeSteps : kSignedSteps;
  const at::Tensor magnitudes = at::exp2(at::arange(count, at::kDouble).div(-steps));  // 1 .. smallest
  const at::Tensor zero = at::zeros({1}, at::kDouble);
  const at::Tensor values = non_negative ? at::cat({zero, magnitudes.flip(0)})
                                         : at::cat({magnitudes.neg(), zero, magnitudes.flip(0)});
  return values.to(at::kFloat);
}

// The table on `device`, made once per device.
const at::Tensor& code_values(bool non_negative, c10::Device device) {
  static std::mutex mutex;
  static std::map<std::pair<bool, std::string>, at::Tensor> tables;
  std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& table = tables[{non_negative, device.str()}];
  if (!table.defined()) table = make_code_values(non_negative).to(device);
  return table;
}

// 2^e (int32 exponents in [-126, 127]) as float32, exactly: the bit pattern.
at::Tensor power_of_two(const at::Tensor& exponent) {
  return exponent.add(127).mul_(int64_t{1} << 23).view(at::kFloat);
}

}  // namespace

bool is_packed_state(const at::Tensor& state) {
  return state.defined() && state.scalar_type() == at::kByte && state.dim() == 2 && state.size(1) == kPackedRow;
}

int64_t packed_blocks(int64_t numel) { return (numel + kStateBlock - 1) / kStateBlock; }

bool packs(const at::Tensor& state, const at::Tensor& param) {
  return is_packed_state(state) && state.is_contiguous() && state.device() == param.device() &&
         state.size(0) == packed_blocks(param.numel());
}

namespace {

// At most this many blocks are coded at once: the coding's temporaries
// (about ten of the slice's size) stay near 2.5 MiB however large the
// tensor, beside a step that frees each gradient as it applies it.
constexpr int64_t kSliceBlocks = 256;

// Codes `x` ([blocks, 256] float32) into `packed`'s rows; `noise`: uniform
// [0, 1) of x's shape (undefined: to nearest).
void code_blocks(const at::Tensor& x, const at::Tensor& noise, const at::Tensor& packed, bool non_negative) {
  const at::Tensor non_finite = x.isfinite().logical_not_().any(1, /*keepdim=*/true);
  // Each block's scale: the smallest power of two holding its maximum.
  const auto [mantissa, exponent] = at::frexp(x.abs().amax(1, /*keepdim=*/true));
  at::Tensor e = exponent.sub(mantissa.eq(0.5).to(at::kInt)).clamp_(kMinExponent, kMaxExponent);
  const at::Tensor y = x.div(power_of_two(e)).clamp_(non_negative ? 0.0 : -1.0, 1.0);

  // Each value between its two neighbouring codes a <= y <= b.
  const at::Tensor& table = code_values(non_negative, x.device());
  const int64_t last = table.numel() - 1;
  const at::Tensor lo = at::bucketize(y, table, /*out_int32=*/true, /*right=*/true).sub_(1).clamp_(0, last);
  const at::Tensor hi = lo.add(1).clamp_max_(last);
  const at::Tensor a = table.index_select(0, lo.view(-1)).view_as(y);
  const at::Tensor b = table.index_select(0, hi.view(-1)).view_as(y);
  // Up with probability (y - a) / (b - a): the expected code value is y. A
  // value on a code stays there.
  const at::Tensor up = noise.defined() ? noise.mul(b - a).lt(y - a) : (y - a).gt(b - y);
  at::Tensor code = lo.add(up.to(at::kInt));

  // A block whose maximum rounded down onto 0.5 is coded one exponent down
  // (its codes doubled), so a block's bytes follow from its values alone.
  const at::Tensor halve =
      at::where(up, b, a).abs_().amax(1, /*keepdim=*/true).eq(0.5).logical_and_(e.gt(kMinExponent));
  const at::Tensor doubled = non_negative ? code.add(code.gt(0).to(at::kInt).mul_(kNonNegativeSteps))
                                          : code.add(code.sub(kSignedZero).sign_().mul_(kSignedSteps));
  code = at::where(halve, doubled, code).masked_fill_(non_finite, 0);
  e = e.sub(halve.to(at::kInt)).masked_fill_(non_finite, kNonFiniteBlock);

  packed.narrow(1, 0, kStateBlock).copy_(code);
  packed.narrow(1, kStateBlock, 1).copy_(e.to(at::kChar).view(at::kByte));
}

// 2^e as float32 from its bit pattern (e in [-126, 127]).
float power_of_two(int e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// code_blocks in one pass per block, on the CPU: the same arithmetic in
// float32 in the same order, so the same bytes.
class BlockCoder {
 public:
  BlockCoder(bool non_negative, const at::Tensor& table)
      : non_negative_(non_negative),
        table_(table.const_data_ptr<float>()),
        last_(static_cast<int>(table.numel()) - 1),
        zero_(non_negative ? 0 : static_cast<int>(kSignedZero)),
        steps_(static_cast<float>(non_negative ? kNonNegativeSteps : kSignedSteps)) {}

  // Codes `count` values (<= 256; the rest of the block zeros) into `row`.
  // `draws` (null: to nearest): the block's 256 32-bit draws, each value's
  // noise at::rand's float of its draw.
  void code(const float* values, int64_t count, const uint32_t* draws, uint8_t* row) const {
    float x[kStateBlock] = {};
    std::copy_n(values, count, x);
    bool non_finite = false;
    float max = 0;
    for (const float v : x) {
      non_finite = non_finite || !std::isfinite(v);
      max = std::max(max, std::abs(v));
    }
    if (non_finite) {  // no scale: codes 0, the exponent byte kNonFiniteBlock (its draws are drawn all the same)
      std::fill_n(row, kStateBlock, uint8_t{0});
      row[kStateBlock] = static_cast<uint8_t>(static_cast<int8_t>(kNonFiniteBlock));
      return;
    }
    int exponent = 0;
    const float mantissa = std::frexp(max, &exponent);
    int e = std::clamp(exponent - (mantissa == 0.5f ? 1 : 0), kMinExponent, kMaxExponent);
    const float scale = power_of_two(e);
    int codes[kStateBlock];
    float chosen_max = 0;
    for (int64_t i = 0; i < kStateBlock; ++i) {
      const float y = std::min(std::max(x[i] / scale, non_negative_ ? 0.0f : -1.0f), 1.0f);
      const int lo = floor_code(y);
      const float a = table_[lo], b = table_[std::min(lo + 1, last_)];
      // Indexed rather than branched on: the noise makes `up` unpredictable.
      const int up = draws != nullptr ? static_cast<float>(draws[i] & 0xFFFFFFu) * 0x1p-24f * (b - a) < (y - a)
                                      : (y - a) > (b - y);
      codes[i] = lo + up;
      chosen_max = std::max(chosen_max, std::abs(table_[lo + up]));
    }
    const bool halve = chosen_max == 0.5f && e > kMinExponent;
    for (int64_t i = 0; i < kStateBlock; ++i) {
      int c = codes[i];
      if (halve) c += non_negative_ ? (c > 0) * kNonNegativeSteps : ((c > kSignedZero) - (c < kSignedZero)) * kSignedSteps;
      row[i] = static_cast<uint8_t>(c);
    }
    e -= halve ? 1 : 0;
    row[kStateBlock] = static_cast<uint8_t>(static_cast<int8_t>(e));
  }

 private:
  // The largest code whose value is <= y (y in the table's range): a guess
  // from y's binary logarithm (its exponent, and its mantissa's first 8
  // bits' logarithm from a table: within 0.006), corrected against the
  // table where a code falls between the guess and y.
  int floor_code(float y) const {
    int lo = zero_;
    if (y != 0) {
      uint32_t bits;
      std::memcpy(&bits, &y, sizeof bits);
      const float log2 = static_cast<float>(static_cast<int>((bits >> 23) & 0xFF) - 127) +
                         log2_of_mantissa()[(bits >> 15) & 0xFF];
      // Code value 2^(-k / steps): the largest at most y is k's ceiling
      // above 0, its floor below.
      const float k = std::min(-log2 * steps_, static_cast<float>(last_));
      lo = y > 0 ? std::max(last_ - static_cast<int>(std::ceil(k)), zero_) : std::min(static_cast<int>(k), zero_ - 1);
    }
    while (lo < last_ && table_[lo + 1] <= y) ++lo;
    while (lo > 0 && table_[lo] > y) --lo;
    return lo;
  }

  // log2(1 + i / 256): a mantissa's logarithm by its first 8 bits, made once.
  static const std::array<float, 256>& log2_of_mantissa() {
    static const std::array<float, 256> table = [] {
      std::array<float, 256> t{};
      for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<float>(std::log2(1.0 + static_cast<double>(i) / t.size()));
      return t;
    }();
    return table;
  }

  bool non_negative_;
  const float* table_;
  int last_, zero_;
  float steps_;
};

// Each block's draws in order, as at::rand draws the noise tensor: one
// stream, so serial, as ATen's draws are.
void pack_in_one_pass(const at::Tensor& values, const at::Tensor& packed, bool non_negative, at::mt19937* engine) {
  const BlockCoder coder(non_negative, code_values(non_negative, values.device()));
  const float* x = values.const_data_ptr<float>();
  uint8_t* rows = packed.mutable_data_ptr<uint8_t>();
  const int64_t numel = values.numel();
  uint32_t draws[kStateBlock];
  for (int64_t block = 0; block < packed.size(0); ++block) {
    if (engine != nullptr) std::generate_n(draws, kStateBlock, [&] { return (*engine)(); });
    const int64_t first = block * kStateBlock;
    coder.code(x + first, std::min(kStateBlock, numel - first), engine ? draws : nullptr, rows + block * kPackedRow);
  }
}

void unpack_in_one_pass(const at::Tensor& packed, const at::Tensor& values, bool non_negative) {
  const at::Tensor& codes = code_values(non_negative, packed.device());
  const float* table = codes.const_data_ptr<float>();
  const int64_t last = codes.numel() - 1;
  float* out = values.mutable_data_ptr<float>();
  const uint8_t* rows = packed.const_data_ptr<uint8_t>();
  const int64_t numel = values.numel();
  for (int64_t block = 0; block * kStateBlock < numel; ++block) {
    const uint8_t* row = rows + block * kPackedRow;
    const int e = static_cast<int8_t>(row[kStateBlock]);
    const float scale =
        e == kNonFiniteBlock ? std::numeric_limits<float>::quiet_NaN() : power_of_two(std::max(e, kMinExponent));
    for (int64_t i = 0, n = std::min(kStateBlock, numel - block * kStateBlock); i < n; ++i) {
      TORCH_CHECK(row[i] <= last, "amp: packed 8-bit state holds code ", static_cast<int>(row[i]),
                  ", which the signed code has not (0..254): the state is damaged");
      out[block * kStateBlock + i] = table[row[i]] * scale;
    }
  }
}

at::Tensor unpack_by_aten_ops(const at::Tensor& packed, at::IntArrayRef sizes, bool non_negative) {
  const int64_t blocks = packed.size(0);
  const at::Tensor& table = code_values(non_negative, packed.device());
  const at::Tensor codes = packed.narrow(1, 0, kStateBlock).reshape(-1).to(at::kInt);
  const at::Tensor exponent = packed.narrow(1, kStateBlock, 1).view(at::kChar).to(at::kInt);
  const at::Tensor scale = power_of_two(exponent.clamp_min(kMinExponent))
                               .masked_fill_(exponent.eq(kNonFiniteBlock), std::numeric_limits<float>::quiet_NaN());
  const at::Tensor values = table.index_select(0, codes).view({blocks, kStateBlock}).mul_(scale);
  return values.view(-1).narrow(0, 0, c10::multiply_integers(sizes)).view(sizes);
}

}  // namespace

void pack_state_into(const at::Tensor& values, const at::Tensor& packed, bool non_negative,
                     StochasticRounding* rounder, RoundingKey key, CpuPath path) {
  const int64_t blocks = packed.size(0), numel = values.numel();
  TORCH_INTERNAL_ASSERT(is_packed_state(packed) && blocks == packed_blocks(numel) && values.scalar_type() == at::kFloat);
  if (path == CpuPath::kOnePass && values.is_cpu() && packed.is_contiguous()) {
    std::optional<at::mt19937> engine;
    if (rounder != nullptr) engine = rounder->cpu_engine(key);
    pack_in_one_pass(values.contiguous(), packed, non_negative, engine ? &*engine : nullptr);
    return;
  }
  at::Tensor x;
  if (numel == blocks * kStateBlock) {
    x = values.reshape({blocks, kStateBlock});
  } else {  // the last block padded with zeros
    x = at::zeros({blocks * kStateBlock}, values.options());
    x.narrow(0, 0, numel).copy_(values.reshape(-1));
    x = x.view({blocks, kStateBlock});
  }
  // The noise is drawn for all of `values` at once, so coding it in slices changes nothing.
  const at::Tensor noise = rounder ? rounder->uniform(x.sizes(), x.device(), key) : at::Tensor();
  for (int64_t first = 0; first < blocks; first += kSliceBlocks) {
    const int64_t count = std::min(kSliceBlocks, blocks - first);
    code_blocks(x.narrow(0, first, count), noise.defined() ? noise.narrow(0, first, count) : at::Tensor(),
                packed.narrow(0, first, count), non_negative);
  }
}

at::Tensor pack_state(const at::Tensor& values, bool non_negative, StochasticRounding* rounder,
                      RoundingKey key, CpuPath path) {
  at::Tensor packed = at::empty({packed_blocks(values.numel()), kPackedRow}, values.options().dtype(at::kByte));
  pack_state_into(values.to(at::kFloat), packed, non_negative, rounder, key, path);
  return packed;
}

at::Tensor packed_zeros(int64_t numel, bool non_negative, const at::TensorOptions& options) {
  at::Tensor packed = at::zeros({packed_blocks(numel), kPackedRow}, options.dtype(at::kByte));  // exponent 0
  packed.narrow(1, 0, kStateBlock).fill_(non_negative ? 0 : kSignedZero);
  return packed;
}

at::Tensor unpack_state(const at::Tensor& packed, at::IntArrayRef sizes, bool non_negative, CpuPath path) {
  TORCH_INTERNAL_ASSERT(is_packed_state(packed));
  if (path == CpuPath::kOnePass && packed.is_cpu() && packed.is_contiguous()) {
    at::Tensor values = at::empty(sizes, packed.options().dtype(at::kFloat));
    unpack_in_one_pass(packed, values, non_negative);
    return values;
  }
  return unpack_by_aten_ops(packed, sizes, non_negative);
}

void unpack_state_into(const at::Tensor& packed, const at::Tensor& values, bool non_negative, CpuPath path) {
  TORCH_INTERNAL_ASSERT(is_packed_state(packed) && packed.size(0) == packed_blocks(values.numel()) &&
                        values.scalar_type() == at::kFloat && values.device() == packed.device());
  if (path == CpuPath::kOnePass && packed.is_cpu() && packed.is_contiguous() && values.is_contiguous()) {
    unpack_in_one_pass(packed, values, non_negative);
    return;
  }
  values.copy_(unpack_by_aten_ops(packed, values.sizes(), non_negative));
}

at::Tensor state_values(const at::Tensor& state, const at::Tensor& param, bool non_negative) {
  return is_packed_state(state) ? unpack_state(state, param.sizes(), non_negative) : state;
}

at::Tensor state_kept_as(const at::Tensor& values, at::ScalarType dtype, bool non_negative) {
  return dtype == at::kByte ? pack_state(values, non_negative, nullptr) : values.to(dtype, false, /*copy=*/true);
}

}  // namespace amp::detail
