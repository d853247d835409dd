// SPDX-License-Identifier: BSD-3-Clause
#include "optim/eight_bit_state.h"

#include "optim/one_pass_kernels.h"
#include "optim/stochastic_rounding.h"
#include "optim/widened_step_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <array>
#include <cmath>
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

// 2^e (int32 exponents in [-126, 127]) as float32, exactly: the bit pattern.
at::Tensor power_of_two(const at::Tensor& exponent) {
  return exponent.add(127).mul_(int64_t{1} << 23).view(at::kFloat);
}

}  // namespace

const at::Tensor& code_values(bool non_negative, c10::Device device) {
  static std::mutex mutex;
  static std::map<std::pair<bool, std::string>, at::Tensor> tables;
  std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& table = tables[{non_negative, device.str()}];
  if (!table.defined()) table = make_code_values(non_negative).to(device);
  return table;
}

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

// The CPU's tables, made once.
const CodeTable& code_table(bool non_negative) {
  static const std::array<CodeTable, 2> tables = [] {
    std::array<CodeTable, 2> t{};
    for (const bool n : {false, true}) {
      const at::Tensor& values = code_values(n, c10::Device(c10::kCPU));
      t[n] = {values.const_data_ptr<float>(), static_cast<int>(values.numel()) - 1,
              n ? 0 : static_cast<int>(kSignedZero), static_cast<int>(n ? kNonNegativeSteps : kSignedSteps), n};
    }
    return t;
  }();
  return tables[non_negative];
}

// Blocks coded a task at a time on ATen's threads.
constexpr int64_t kBlocksPerTask = 64;

// code_blocks in one pass per block on the CPU (one_pass_kernels.h), the
// blocks coded in parallel: each block's draws are its own counters'.
void pack_in_one_pass(const at::Tensor& values, const at::Tensor& packed, bool non_negative,
                      std::optional<uint64_t> seed, CodeBlocksFn code) {
  const CodeTable& table = code_table(non_negative);
  const float* x = values.const_data_ptr<float>();
  uint8_t* rows = packed.mutable_data_ptr<uint8_t>();
  const int64_t numel = values.numel();
  at::parallel_for(0, packed.size(0), kBlocksPerTask, [&](int64_t first, int64_t last) {
    code(table, x, numel, first, last - first, seed ? &*seed : nullptr, rows);
  });
}

void unpack_in_one_pass(const at::Tensor& packed, const at::Tensor& values, bool non_negative,
                        DecodeBlocksFn decode = one_pass_kernels().decode_blocks) {
  const CodeTable& codes = code_table(non_negative);
  const uint8_t* rows = packed.const_data_ptr<uint8_t>();
  const int64_t damaged = decode(codes, rows, values.numel(), 0, packed.size(0), values.mutable_data_ptr<float>());
  TORCH_CHECK(damaged < 0, "amp: packed 8-bit state holds code ",
              damaged < 0 ? 0 : static_cast<int>(rows[damaged / kStateBlock * kPackedRow + damaged % kStateBlock]),
              ", which the ", non_negative ? "non-negative" : "signed", " code has not (0..", codes.last,
              "): the state is damaged");
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

void pack_state_into_by(CodeBlocksFn kernel, const at::Tensor& values, const at::Tensor& packed, bool non_negative,
                        StochasticRounding* rounder, RoundingKey key) {
  TORCH_INTERNAL_ASSERT(is_packed_state(packed) && packed.size(0) == packed_blocks(values.numel()) &&
                        values.scalar_type() == at::kFloat && values.is_cpu() && packed.is_contiguous());
  std::optional<uint64_t> seed;
  if (rounder != nullptr) seed = rounder->stream_seed(key);
  pack_in_one_pass(values.contiguous(), packed, non_negative, seed, kernel);
}

namespace {

// Whether amp's CUDA kernel packs `values` into `packed` (`path` kOnePass).
bool packs_on_cuda(const at::Tensor& values, const at::Tensor& packed, CpuPath path) {
#ifdef AMP_WITH_CUDA_KERNELS
  return path == CpuPath::kOnePass && packed.is_contiguous() && widened_step_kernels_apply(values);
#else
  return false;
#endif
}

void pack_by_cuda_kernel(const std::vector<StatePacking>& packings, StochasticRounding* rounder) {
#ifdef AMP_WITH_CUDA_KERNELS
  std::vector<CudaPacking> jobs;
  for (const StatePacking& p : packings) {
    std::optional<uint64_t> seed;
    if (rounder != nullptr) seed = rounder->stream_seed(p.key);
    jobs.push_back({p.values.contiguous(), p.packed, code_values(p.non_negative, p.values.device()), p.non_negative, seed});
  }
  pack_on_cuda(jobs);
#else
  TORCH_INTERNAL_ASSERT(packings.empty(), "amp: this build has no CUDA kernels");
#endif
}

}  // namespace

void pack_states_into(const std::vector<StatePacking>& packings, StochasticRounding* rounder) {
  std::vector<StatePacking> on_cuda;
  for (const StatePacking& p : packings) {
    if (packs_on_cuda(p.values, p.packed, CpuPath::kOnePass) &&
        (on_cuda.empty() || on_cuda.front().values.device() == p.values.device())) {
      on_cuda.push_back(p);
    } else {
      pack_state_into(p.values, p.packed, p.non_negative, rounder, p.key);
    }
  }
  pack_by_cuda_kernel(on_cuda, rounder);
}

void pack_state_into(const at::Tensor& values, const at::Tensor& packed, bool non_negative,
                     StochasticRounding* rounder, RoundingKey key, CpuPath path) {
  const int64_t blocks = packed.size(0), numel = values.numel();
  TORCH_INTERNAL_ASSERT(is_packed_state(packed) && blocks == packed_blocks(numel) && values.scalar_type() == at::kFloat);
  if (path == CpuPath::kOnePass && values.is_cpu() && packed.is_contiguous()) {
    pack_state_into_by(one_pass_kernels().code_blocks, values, packed, non_negative, rounder, key);
    return;
  }
  if (packs_on_cuda(values, packed, path)) {
    pack_by_cuda_kernel({{values, packed, non_negative, key}}, rounder);
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

void unpack_state_into_by(DecodeBlocksFn kernel, const at::Tensor& packed, const at::Tensor& values, bool non_negative) {
  TORCH_INTERNAL_ASSERT(is_packed_state(packed) && packed.size(0) == packed_blocks(values.numel()) &&
                        values.scalar_type() == at::kFloat && packed.is_cpu() && packed.is_contiguous() &&
                        values.is_contiguous());
  unpack_in_one_pass(packed, values, non_negative, kernel);
}

namespace {

// Whether amp's CUDA kernel decodes `packed` into `values` (`path` kOnePass).
bool unpacks_on_cuda(const at::Tensor& packed, const at::Tensor& values, CpuPath path) {
#ifdef AMP_WITH_CUDA_KERNELS
  return path == CpuPath::kOnePass && packed.is_contiguous() && values.is_contiguous() &&
         widened_step_kernels_apply(packed);
#else
  return false;
#endif
}

void unpack_by_cuda_kernel(const std::vector<StateUnpacking>& unpackings) {
#ifdef AMP_WITH_CUDA_KERNELS
  std::vector<CudaUnpacking> jobs;
  for (const StateUnpacking& u : unpackings) {
    jobs.push_back({u.packed, u.values, code_values(u.non_negative, u.packed.device()), u.non_negative});
  }
  unpack_on_cuda(jobs);
#else
  TORCH_INTERNAL_ASSERT(unpackings.empty(), "amp: this build has no CUDA kernels");
#endif
}

}  // namespace

at::Tensor unpack_state(const at::Tensor& packed, at::IntArrayRef sizes, bool non_negative, CpuPath path) {
  TORCH_INTERNAL_ASSERT(is_packed_state(packed));
  if (path == CpuPath::kOnePass && packed.is_cpu() && packed.is_contiguous()) {
    at::Tensor values = at::empty(sizes, packed.options().dtype(at::kFloat));
    unpack_in_one_pass(packed, values, non_negative);
    return values;
  }
  if (unpacks_on_cuda(packed, packed, path)) {
    at::Tensor values = at::empty(sizes, packed.options().dtype(at::kFloat));
    unpack_by_cuda_kernel({{packed, values, non_negative}});
    return values;
  }
  return unpack_by_aten_ops(packed, sizes, non_negative);
}


void unpack_states_into(const std::vector<StateUnpacking>& unpackings) {
  std::vector<StateUnpacking> on_cuda;
  for (const StateUnpacking& u : unpackings) {
    if (unpacks_on_cuda(u.packed, u.values, CpuPath::kOnePass) &&
        (on_cuda.empty() || on_cuda.front().packed.device() == u.packed.device())) {
      TORCH_INTERNAL_ASSERT(is_packed_state(u.packed) && u.packed.size(0) == packed_blocks(u.values.numel()) &&
                            u.values.scalar_type() == at::kFloat && u.values.device() == u.packed.device());
      on_cuda.push_back(u);
    } else {
      unpack_state_into(u.packed, u.values, u.non_negative);
    }
  }
  unpack_by_cuda_kernel(on_cuda);
}

void unpack_state_into(const at::Tensor& packed, const at::Tensor& values, bool non_negative, CpuPath path) {
  TORCH_INTERNAL_ASSERT(is_packed_state(packed) && packed.size(0) == packed_blocks(values.numel()) &&
                        values.scalar_type() == at::kFloat && values.device() == packed.device());
  if (path == CpuPath::kOnePass && packed.is_cpu() && packed.is_contiguous() && values.is_contiguous()) {
    unpack_in_one_pass(packed, values, non_negative);
    return;
  }
  if (unpacks_on_cuda(packed, values, path)) {
    unpack_by_cuda_kernel({{packed, values, non_negative}});
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
