// SPDX-License-Identifier: BSD-3-Clause
#include "optim/fused_stepping.h"

#include "optim/eight_bit_state.h"
#include "optim/one_pass_kernels.h"
#include "optim/optimizer_kinds.h"
#include "optim/widened_step_kernels.h"
#include "support/host_read.h"
#include "support/raw_view.h"
#include "support/trace_range.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>
#include <optional>

namespace amp::optim::internal {
namespace {

bool kernel_ready(const at::Tensor& t, const at::Tensor& param, c10::ScalarType dtype) {
  if (dtype == at::kByte) return !t.defined() || detail::packs(t, param);
  return !t.defined() || (t.layout() == at::kStrided && t.is_contiguous() && t.scalar_type() == dtype &&
                          t.device() == param.device() && t.sizes() == param.sizes());
}

// At most this many elements of parameters are widened to float32 at once
// (step_widened): 4 MiB per widened list, a few per step - a transient
// that stays small beside the bytes O6 and 8-bit state save, however large
// a tensor (a larger one is stepped in slices of this many). A multiple of
// the 8-bit state's blocks, so a slice's packed rows are whole blocks.
constexpr int64_t kChunkElements = int64_t{1} << 20;
static_assert(kChunkElements % detail::kStateBlock == 0);

// Elements [offset, offset + length) of parameter `index`: the `part`th
// slice of it.
struct Slice {
  size_t index;
  int64_t offset, length;
  uint64_t part;
};

// Each parameter in slices of at most kChunkElements (one slice, the whole
// tensor, below that).
std::vector<Slice> slices_of(const std::vector<at::Tensor>& params) {
  std::vector<Slice> slices;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t numel = params[i].numel();
    uint64_t part = 0;
    int64_t offset = 0;
    do {
      slices.push_back({i, offset, std::min(kChunkElements, numel - offset), part++});
      offset += kChunkElements;
    } while (offset < numel);
  }
  return slices;
}

// `t` (a column's tensor of the slice's parameter, `numel` values) for
// `slice`: the tensor itself where the slice is the whole of it, else its
// flattened values' slice, or a packed state's rows of them.
at::Tensor slice_of(const at::Tensor& t, const Slice& slice, int64_t numel) {
  if (slice.offset == 0 && slice.length == numel) return t;
  if (detail::is_packed_state(t)) {
    return t.narrow(0, slice.offset / detail::kStateBlock, detail::packed_blocks(slice.length));
  }
  return t.view(-1).narrow(0, slice.offset, slice.length);
}

// `piece` (1-D) as `shape`; a view only where that differs.
at::Tensor shaped(const at::Tensor& piece, const std::vector<int64_t>& shape) {
  return shape.size() == 1 ? piece : piece.view(shape);
}

// One column's `parts` of a chunk in float32, each shaped `shapes[i]`:
// float32 ones as they are, the others widened into one buffer, so the ops
// a chunk runs do not grow with the number of tensors in it (on a GPU, its
// kernel launches: widening a tensor at a time launched one each). On the
// CPU the bfloat16 ones are widened by amp's loop (one_pass_kernels.h)
// into pieces of the buffer; on other devices by one `cat` and one
// conversion. Packed state is unpacked into its piece on every device (on
// CUDA, all of the column's by one launch).
std::vector<at::Tensor> widen(const std::vector<at::Tensor>& parts, const std::vector<std::vector<int64_t>>& shapes,
                              bool non_negative) {
  std::vector<at::Tensor> wide(parts.size()), narrow;
  std::vector<size_t> narrow_at, packed_at;
  std::vector<int64_t> narrow_lengths, packed_lengths;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].scalar_type() == at::kBFloat16) {
      narrow_at.push_back(i);
      narrow.push_back(parts[i]);
      narrow_lengths.push_back(parts[i].numel());
    } else if (detail::is_packed_state(parts[i])) {
      packed_at.push_back(i);
      packed_lengths.push_back(c10::multiply_integers(shapes[i]));
    } else {
      wide[i] = parts[i];
    }
  }
  if (parts.empty()) return wide;
  const bool on_cpu = parts[0].is_cpu();
  if (!narrow.empty() && !on_cpu) {
    for (at::Tensor& t : narrow) t = t.dim() == 1 ? t : t.view(-1);
    const at::Tensor joined = narrow.size() == 1 ? narrow[0] : at::cat(narrow);
    const std::vector<at::Tensor> pieces = joined.to(at::kFloat).split_with_sizes(narrow_lengths);
    for (size_t k = 0; k < narrow_at.size(); ++k) wide[narrow_at[k]] = shaped(pieces[k], shapes[narrow_at[k]]);
    narrow_at.clear();
    narrow_lengths.clear();
  }
  if (narrow_at.empty() && packed_at.empty()) return wide;
  const int64_t total = std::accumulate(narrow_lengths.begin(), narrow_lengths.end(), int64_t{0}) +
                        std::accumulate(packed_lengths.begin(), packed_lengths.end(), int64_t{0});
  const at::Tensor buffer = at::empty({total}, parts[0].options().dtype(at::kFloat));
  int64_t offset = 0;
  const detail::WidenFn widen_bfloat16 = on_cpu ? detail::one_pass_kernels().widen_bfloat16 : nullptr;
  for (size_t k = 0; k < narrow_at.size(); ++k) {  // the CPU's bfloat16 parts
    const size_t i = narrow_at[k];
    TORCH_INTERNAL_ASSERT(narrow[k].is_contiguous());
    wide[i] = detail::raw_view(buffer, offset, shapes[i]);
    widen_bfloat16(reinterpret_cast<const uint16_t*>(narrow[k].const_data_ptr<at::BFloat16>()),
                   reinterpret_cast<uint32_t*>(wide[i].mutable_data_ptr<float>()), narrow_lengths[k]);
    offset += narrow_lengths[k];
  }
  std::vector<detail::StateUnpacking> unpackings;  // decoded together: on CUDA a launch
  for (size_t k = 0; k < packed_at.size(); ++k) {
    const size_t i = packed_at[k];
    wide[i] = detail::raw_view(buffer, offset, shapes[i]);
    unpackings.push_back({parts[i], wide[i], non_negative});
    offset += packed_lengths[k];
  }
  detail::unpack_states_into(unpackings);
  return wide;
}

}  // namespace

void step_widened(const std::vector<WideColumn>& columns, const std::vector<uint64_t>& keys,
                  const UpdatePrecision& precision,
                  const std::function<void(const std::vector<std::vector<at::Tensor>>&)>& kernel) {
  detail::StochasticRounding& rounder = *precision.rounder;
  const std::vector<at::Tensor>& params = *columns[0].tensors;
  const std::vector<Slice> slices = slices_of(params);
  for (size_t begin = 0; begin < slices.size();) {
    size_t end = begin;
    for (int64_t elements = 0;
         end < slices.size() && (end == begin || elements + slices[end].length <= kChunkElements); ++end) {
      elements += slices[end].length;
    }
    // A slice's values keep its parameter's shape where it is the whole of it.
    std::vector<std::vector<int64_t>> shapes;
    for (size_t s = begin; s < end; ++s) {
      const at::Tensor& param = params[slices[s].index];
      shapes.push_back(slices[s].length == param.numel() ? param.sizes().vec() : std::vector<int64_t>{slices[s].length});
    }
    std::vector<std::vector<at::Tensor>> parts(columns.size()), wide(columns.size());
    for (size_t c = 0; c < columns.size(); ++c) {
      for (size_t s = begin; s < end && !columns[c].tensors->empty(); ++s) {
        const Slice& slice = slices[s];
        const at::Tensor& t = (*columns[c].tensors)[slice.index];
        parts[c].push_back(columns[c].whole ? t : slice_of(t, slice, params[slice.index].numel()));
      }
      wide[c] = columns[c].whole ? parts[c] : widen(parts[c], shapes, columns[c].non_negative);
    }
    kernel(wide);
    // The chunk's bfloat16 results rounded together, its packed state coded
    // together (on CUDA a launch each).
    std::vector<detail::StochasticRounding::Rounding> roundings;
    std::vector<detail::StatePacking> packings;
    for (size_t c = 0; c < columns.size(); ++c) {
      if (!columns[c].written) continue;
      for (size_t s = begin; s < end && !columns[c].tensors->empty(); ++s) {
        const at::Tensor& part = parts[c][s - begin];
        const detail::RoundingKey key{precision.step, keys[slices[s].index] * columns.size() + c, slices[s].part};
        if (part.scalar_type() == at::kBFloat16) roundings.push_back({wide[c][s - begin], part, key});
        if (detail::is_packed_state(part)) packings.push_back({wide[c][s - begin], part, columns[c].non_negative, key});
      }
    }
    rounder.round_all(roundings);
    detail::pack_states_into(packings, &rounder);
    begin = end;
  }
}

std::vector<std::vector<detail::CudaWidePiece>> pieces_in_place(const std::vector<WideColumn>& columns,
                                                                 const std::vector<uint64_t>& keys,
                                                                 const UpdatePrecision& precision) {
#ifdef AMP_WITH_CUDA_KERNELS
  const std::vector<at::Tensor>& params = *columns[0].tensors;
  if (!detail::widened_steps_fused() || params.empty() || !detail::widened_step_kernels_apply(params[0])) return {};
  const c10::Device device = params[0].device();
  for (const WideColumn& column : columns) {
    for (const at::Tensor& t : *column.tensors) {
      const c10::ScalarType dtype = t.scalar_type();
      const bool kept = dtype == at::kFloat || dtype == at::kBFloat16 || detail::is_packed_state(t);
      if (!kept || t.device() != device || !t.is_contiguous()) return {};
    }
  }
  std::vector<at::Tensor> tables(columns.size());  // each column's code, looked up once
  std::vector<std::vector<detail::CudaWidePiece>> slices;
  for (const Slice& slice : slices_of(params)) {
    const int64_t numel = params[slice.index].numel();
    std::vector<detail::CudaWidePiece>& pieces = slices.emplace_back(columns.size());
    for (size_t c = 0; c < columns.size(); ++c) {
      if (columns[c].tensors->empty()) continue;
      const at::Tensor& t = (*columns[c].tensors)[slice.index];
      detail::CudaWidePiece& piece = pieces[c];
      piece.t = columns[c].whole ? t : slice_of(t, slice, numel);
      piece.non_negative = columns[c].non_negative;
      if (detail::is_packed_state(t)) {
        if (!tables[c].defined()) tables[c] = detail::code_values(piece.non_negative, device);
        piece.table = tables[c];
      }
      // step_widened's streams: the slice's, this column's.
      const detail::RoundingKey key{precision.step, keys[slice.index] * columns.size() + c, slice.part};
      if (columns[c].written && t.scalar_type() != at::kFloat) piece.seed = precision.rounder->stream_seed(key);
    }
  }
  return slices;
#else
  return {};
#endif
}

// ---- FusedStepping ------------------------------------------------------------

c10::ScalarType state_dtype_of(const at::Tensor& p, const UpdatePrecision* precision) {
  return detail::kept_state_dtype(p, precision ? std::optional(precision->state_dtype) : std::nullopt);
}

bool steps_widened(const at::Tensor& p, const UpdatePrecision* precision) {
  return precision != nullptr && ((precision->rounds_weights && p.scalar_type() == at::kBFloat16) ||
                                  state_dtype_of(p, precision) == at::kByte);
}

at::Tensor zero_state(const at::Tensor& p, const UpdatePrecision* precision, bool non_negative) {
  const c10::ScalarType dtype = state_dtype_of(p, precision);
  if (dtype == at::kByte) return detail::packed_zeros(p.numel(), non_negative, p.options());
  return at::zeros_like(p, p.options().dtype(dtype), at::MemoryFormat::Preserve);
}

bool FusedStepping::suits_parameter(const torch::optim::Optimizer& optimizer,
                                    const torch::optim::OptimizerParamGroup& group, const at::Tensor& p,
                                    const UpdatePrecision* precision) const {
  const at::Tensor& grad = p.grad();
  // ATen's fused kernels take the four floating dtypes; float16 and
  // bfloat16 parameters (O3) keep their state in their own dtype, as
  // LibTorch's step creates it, where the kernel steps them; O6's are
  // stepped widened to float32.
  const c10::ScalarType dtype = p.scalar_type();
  const bool reduced = dtype == at::kHalf || dtype == at::kBFloat16;
  if (dtype != at::kFloat && dtype != at::kDouble && !reduced) return false;
  if (reduced && !steps_widened(p, precision) && !kernel_.steps_low_precision_on_cpu() && p.is_cpu()) return false;
  if (!(p.is_cpu() || p.is_cuda()) || !p.is_contiguous() || !kernel_ready(grad, p, p.scalar_type())) return false;
  auto s = optimizer.state().find(p.unsafeGetTensorImpl());
  if (s == optimizer.state().end()) return true;
  int64_t step = 0;
  const std::vector<detail::StateTensor> tensors = detail::state_tensors(*s->second, step);
  if (tensors.empty()) return false;  // state of another kind
  const c10::ScalarType state_dtype = state_dtype_of(p, precision);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (kernel_.needs_state(group.options(), i) && (!tensors[i].value.defined() || !kernel_ready(tensors[i].value, p, state_dtype))) return false;
  }
  return true;
}

bool FusedStepping::suits(const torch::optim::Optimizer& optimizer, const UpdatePrecision* precision) const {
  std::optional<c10::Device> device;
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (!suits_parameter(optimizer, group, p, precision) || (device && *device != p.device())) return false;
      device = p.device();
    }
  }
  return true;
}

FusedAttempt FusedStepping::step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf,
                                  const UpdatePrecision* precision) {
  AMP_TRACE_RANGE("amp::fused step");
  // A step that rounds draws its number; one without gradients steps
  // nothing and draws none (after a step applied in backward, a resumed
  // run's step() finds none either).
  bool any_gradient = false;
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) any_gradient = any_gradient || p.grad().defined();
  }
  std::optional<UpdatePrecision> this_step;
  if (precision != nullptr && any_gradient) {
    this_step = *precision;
    this_step->step = precision->rounder->next_step();
  }
  FusedAttempt attempt;
  uint64_t first = 0;  // the group's first parameter's position in the optimizer
  for (auto& group : optimizer.param_groups()) {
    std::vector<uint64_t> keys(group.params().size());
    std::iota(keys.begin(), keys.end(), first);
    first += keys.size();
    run_kernel(optimizer, group, group.params(), keys, found_inf, this_step ? &*this_step : nullptr, attempt);
  }
  return attempt;
}

FusedAttempt FusedStepping::step_parameter(torch::optim::Optimizer& optimizer, size_t group, uint64_t key,
                                           const at::Tensor& param, const UpdatePrecision* precision) {
  FusedAttempt attempt;
  run_kernel(optimizer, optimizer.param_groups()[group], {param}, {key}, at::Tensor(), precision, attempt);
  return attempt;
}

void FusedStepping::run_kernel(torch::optim::Optimizer& optimizer, torch::optim::OptimizerParamGroup& group,
                               const std::vector<at::Tensor>& params, const std::vector<uint64_t>& keys,
                               const at::Tensor& found_inf, const UpdatePrecision* precision, FusedAttempt& attempt) {
  at::NoGradGuard no_grad;
  auto device_step = [this](void* key, int64_t host, const at::Tensor& param) -> at::Tensor& {
    at::Tensor& count = device_steps_[key];
    if (!count.defined()) count = at::full({}, static_cast<double>(host), param.options().dtype(at::kFloat));
    return count;
  };
  GroupStep step{group, params, keys, optimizer.state(), found_inf, precision, attempt, device_step};
  kernel_.step(step);
}

void FusedStepping::settle(const FusedAttempt& attempt, bool skipped, StateMap& state) {
  if (skipped) {  // LibTorch creates no state on a step it does not take
    for (void* key : attempt.created) {
      state.erase(key);
      device_steps_.erase(key);
    }
    return;
  }
  for (void* key : attempt.stepped) {
    if (auto it = state.find(key); it != state.end()) detail::count_step(*it->second);
  }
}

bool FusedStepping::holds_all_state(const torch::optim::Optimizer& optimizer) const {
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      void* key = p.unsafeGetTensorImpl();
      if (!optimizer.state().count(key)) return false;
      if (kernel_.counts_steps() && !device_steps_.count(key)) return false;
    }
  }
  return true;
}

void FusedStepping::adopt_device_counts(StateMap& state) {
  std::vector<void*> keys;
  std::vector<at::Tensor> counts;
  for (const auto& [key, count] : device_steps_) {
    if (!state.count(key)) continue;
    keys.push_back(key);
    counts.push_back(count);
  }
  if (keys.empty()) return;
  const at::Tensor host = at::stack(counts).to(at::kDouble).cpu();  // one host sync
  detail::count_host_read();
  for (size_t i = 0; i < keys.size(); ++i) {
    detail::set_step_count(*state.at(keys[i]), static_cast<int64_t>(host[i].item<double>()));
  }
}

}  // namespace amp::optim::internal
