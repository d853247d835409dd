// SPDX-License-Identifier: BSD-3-Clause
#include "fp8/fp8_scaler.h"

#include "fp8/fp8_quantize.h"

#include <amp/telemetry.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <utility>

namespace amp::detail {
namespace {

// The least amax whose own scale is used: the float32 after factor / FLT_MAX,
// as amax compares in float32.
float smallest_usable_amax(double factor) {
  const float tiny = static_cast<float>(factor / std::numeric_limits<float>::max());
  return std::nextafter(tiny, std::numeric_limits<float>::infinity());
}

double largest(at::ScalarType format) {
  switch (format) {
    case at::kFloat8_e4m3fn:
      return static_cast<double>(std::numeric_limits<c10::Float8_e4m3fn>::max());
    case at::kFloat8_e5m2:
      return static_cast<double>(std::numeric_limits<c10::Float8_e5m2>::max());
    default:
      TORCH_CHECK(false, "amp: float8 scaling needs float8_e4m3fn or float8_e5m2, got ", format);
  }
}

}  // namespace

Fp8Scaler::Fp8Scaler(const Options::Fp8Scaling& recipe, at::ScalarType format, bool tally)
    : recipe_(recipe), format_(format), fp8_max_(largest(format)), tallying_(tally) {}

void Fp8Scaler::place(const at::Tensor& like) {
  if (scale_.defined() && scale_.device() == like.device()) return;
  if (scale_.defined()) {  // the model moved: its scaling moves with it
    adopt(scale_.to(like.device()), history_.to(like.device()), updated_.to(like.device()));
    return;
  }
  const auto options = like.options().dtype(at::kFloat);
  adopt(at::ones({1}, options), at::zeros({recipe_.amax_history_len}, options), at::zeros({1}, options));
}

void Fp8Scaler::adopt(at::Tensor scale, at::Tensor history, at::Tensor updated) {
  scale_ = std::move(scale);
  history_ = std::move(history);
  updated_ = std::move(updated);
  current_ = history_.narrow(0, 0, 1);
  spare_ = at::empty_like(history_);
}

// TE's formula, fp8_max / amax / 2^margin, as 1 / amax times this factor (a
// power of two scales exactly, so the order changes no bit).
double Fp8Scaler::scale_factor() const { return fp8_max_ / std::ldexp(1.0, recipe_.margin); }

at::Tensor Fp8Scaler::fresh_scale(const at::Tensor& amax) const {
  return amax.reciprocal().mul_(scale_factor());
}

at::Tensor fp8_transposed(const at::Tensor& m) {
#ifdef AMP_WITH_FP8_KERNELS
  if (fused_fp8_transpose_applies(m)) return fused_fp8_transpose(m);
#endif
  return m.t().contiguous();
}

#ifdef AMP_WITH_FP8_KERNELS
// Two kernels where the ATen path takes a dozen launches (the tally's counts
// stay with ATen's), for an x they take.
bool Fp8Scaler::fused_applies(const at::Tensor& x, bool tally) const {
  return !(tallying_ && tally) && fused_fp8_quantize_applies(x);
}

Fp8QuantizeState Fp8Scaler::fused_state(const at::Tensor& x) {
  place(x);
  dirty_ = true;
  const bool delayed = recipe_.recipe == Options::Fp8Scaling::Recipe::kDelayed;
  return {scale_, updated_, current_, delayed, scale_factor(), smallest_usable_amax(scale_factor()), fp8_max_, format_};
}
#endif

std::pair<at::Tensor, at::Tensor> Fp8Scaler::quantize(const at::Tensor& x, bool tally) {
#ifdef AMP_WITH_FP8_KERNELS
  if (fused_applies(x, tally)) return fused_fp8_quantize(x, fused_state(x));
#endif
  return quantize_reference(x, tally);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> Fp8Scaler::quantize_transposed(const at::Tensor& x, bool tally) {
  TORCH_INTERNAL_ASSERT(x.dim() == 2, "amp: quantize_transposed takes a matrix");
#ifdef AMP_WITH_FP8_KERNELS
  if (fused_applies(x, tally)) return fused_fp8_quantize_transposed(x, fused_state(x));
#endif
  auto [x8, inverse] = quantize_reference(x, tally);
  return {x8, inverse, fp8_transposed(x8)};
}

// Each call is a handful of launches on a GPU, where a small layer's step is
// the host's work: the scale's arithmetic is kept to the fewest ATen calls.
std::pair<at::Tensor, at::Tensor> Fp8Scaler::quantize_reference(const at::Tensor& x, bool tally) {
  place(x);
  dirty_ = true;
  // max |x| in float32, one reduction (NaN where x holds one, inf for an inf).
  const at::Tensor amax = at::linalg_vector_norm(x, INFINITY, std::nullopt, false, at::kFloat);
  // amax's own scale where that is finite and positive, else the delayed one.
  // (tiny, FLT_MAX] as a clamp that leaves amax unchanged: NaN and inf fail.
  const at::Tensor usable =
      amax.clamp(smallest_usable_amax(scale_factor()), std::numeric_limits<float>::max()).eq(amax);
  at::Tensor scale = at::where(usable, fresh_scale(amax), scale_);
  if (recipe_.recipe == Options::Fp8Scaling::Recipe::kDelayed) {
    at::maximum_out(current_, current_, amax.nan_to_num(0, 0, 0));
    scale = at::lerp(scale, scale_, updated_);  // no history yet (updated_ 0): current
  }
  at::Tensor scaled = x * scale;  // float32: the scale's dtype
  const bool counted = tallying_ && tally;
  at::Tensor saturated;
  if (counted) saturated = scaled.abs().gt(fp8_max_).sum();
  const at::Tensor x8 = scaled.clamp_(-fp8_max_, fp8_max_).to(format_);
  if (counted) add_to_tally(x, x8, saturated, amax.reshape({1}), scale);
  // + 0 * amax: unchanged where x is finite, NaN where it is not.
  return {x8, scale.reciprocal().add_(amax, /*alpha=*/0).reshape({})};
}

void Fp8Scaler::add_to_tally(const at::Tensor& x, const at::Tensor& x8, const at::Tensor& saturated,
                      const at::Tensor& amax, const at::Tensor& scale) {
  if (!tally_.counts.defined()) {
    tally_.counts = at::zeros({2}, amax.options().dtype(at::kLong));
    tally_.amax = at::zeros({1}, amax.options());
  }
  const at::Tensor flushed = x8.to(at::kFloat).eq(0).logical_and_(x.ne(0)).sum();
  tally_.counts.add_(at::stack({saturated, flushed}));
  tally_.amax = at::maximum(tally_.amax, amax);
  tally_.scale = scale.clone();
  tally_.calls += 1;
  tally_.numel += x.numel();
}

bool Fp8Scaler::begin_update() {
  if (!dirty_) return false;
  dirty_ = false;
  ++generation_;
  if (tallying_) completed_ = std::exchange(tally_, Fp8Tally{});
  return recipe_.recipe == Options::Fp8Scaling::Recipe::kDelayed;
}

void Fp8Scaler::update() {
  if (begin_update()) update_delayed({this});
}

// One batch of _foreach_ calls for every scaler (a GPT-2-small has 147): a
// few launches, where a scaler at a time took eleven each. Without where
// (there is no _foreach_ form): amax >= 0 is finite (quantize and restore
// keep the history so), its sign p is 1 where it sets the scale, and
// lerp(scale, fresh, p) is exactly fresh at 1 and scale at 0 - fresh is
// clamped finite, as 0 * inf would be NaN.
void Fp8Scaler::update_delayed(const std::vector<Fp8Scaler*>& scalers) {
  if (scalers.empty()) return;
  std::vector<at::Tensor> histories, amaxes, scales, updated;
  std::vector<at::Scalar> factors;
  const bool most_recent = scalers.front()->recipe_.amax_compute == Options::Fp8Scaling::Amax::kMostRecent;
  for (Fp8Scaler* s : scalers) {
    TORCH_CHECK(s->recipe_.amax_compute == scalers.front()->recipe_.amax_compute, "amp: fp8 scalers of one "
                "update share a recipe");
    histories.push_back(s->history_);
    if (most_recent) amaxes.push_back(s->current_);
    scales.push_back(s->scale_);
    updated.push_back(s->updated_);
    factors.emplace_back(s->scale_factor());
  }
  if (!most_recent) {
    amaxes = at::_foreach_max(histories);
    for (at::Tensor& a : amaxes) a = a.reshape({1});
  }
  std::vector<at::Tensor> fresh = at::_foreach_reciprocal(amaxes);
  at::_foreach_mul_(fresh, factors);
  at::_foreach_clamp_max_(fresh, std::numeric_limits<float>::max());
  const std::vector<at::Tensor> sets = at::_foreach_sign(amaxes);
  at::_foreach_lerp_(scales, fresh, sets);
  at::_foreach_maximum_(updated, sets);
  // TE's roll: the history rolls left by one ([a0, h1, ..., h(L-1)] to
  // [h1, ..., h(L-1), a0]) and its first slot is zeroed for the next
  // iteration - assembled in the spare buffer and copied back, so the state
  // stays in the memory a captured CUDA graph's replays read and write.
  std::vector<at::Tensor> head_to, head_from, last_to, last_from, first;
  for (Fp8Scaler* s : scalers) {
    const int64_t n = s->history_.size(0);
    if (n > 1) {
      head_to.push_back(s->spare_.narrow(0, 0, n - 1));
      head_from.push_back(s->history_.narrow(0, 1, n - 1));
    }
    last_to.push_back(s->spare_.narrow(0, n - 1, 1));
    last_from.push_back(s->current_);
    first.push_back(s->spare_.narrow(0, 0, 1));
  }
  if (!head_to.empty()) at::_foreach_copy_(head_to, head_from);
  at::_foreach_copy_(last_to, last_from);
  at::_foreach_zero_(first);
  std::vector<at::Tensor> spares;
  for (Fp8Scaler* s : scalers) spares.push_back(s->spare_);
  at::_foreach_copy_(histories, spares);
}

void Fp8Scaler::save(torch::serialize::OutputArchive& archive) const {
  const at::Tensor none = at::empty({0});
  archive.write("scale", scale_.defined() ? scale_.cpu() : none);
  archive.write("amax_history", history_.defined() ? history_.cpu() : none);
  archive.write("updated", updated_.defined() ? updated_.cpu() : none);
}

void Fp8Scaler::check_saved(torch::serialize::InputArchive& archive, const std::string& what) const {
  at::Tensor scale, history, updated;
  TORCH_CHECK(archive.try_read("scale", scale) && archive.try_read("amax_history", history) &&
                  archive.try_read("updated", updated),
              "amp: the state's fp8 entry for ", what, " lacks its scale, amax_history or updated tensor.");
  if (scale.numel() == 0) return;  // saved before the site's first forward
  TORCH_CHECK(scale.numel() == 1 && updated.numel() == 1 && scale.scalar_type() == at::kFloat,
              "amp: the state's fp8 scale for ", what, " is malformed.");
  TORCH_CHECK(history.dim() == 1 && history.size(0) == recipe_.amax_history_len, "amp: the state's fp8 amax "
              "history for ", what, " holds ", history.numel(), " entries, but Options::fp8_scaling."
              "amax_history_len is ", recipe_.amax_history_len, "; initialize with the checkpoint's fp8_scaling.");
}

void Fp8Scaler::restore(torch::serialize::InputArchive& archive) {
  at::Tensor scale, history, updated;
  archive.read("scale", scale);
  archive.read("amax_history", history);
  archive.read("updated", updated);
  if (scale.numel() == 0) return;
  ++generation_;
  adopt(scale, history.nan_to_num(0, 0, 0), updated);
}

}  // namespace amp::detail

namespace amp {

std::string fp8_quantization_path(c10::Device device) {
  if (!device.is_cuda()) {
    return "ATen ops; float8 GEMMs are emulated on the CPU (float32 GEMMs of the float8 values: float8's "
           "rounding, not its speed)";
  }
#ifdef AMP_WITH_FP8_KERNELS
  if (detail::fp8_kernels_run_on(device.index())) {
    return "amp's fused CUDA kernels (fp8_quantize.cu, built for sm_" AMP_FP8_KERNEL_ARCHS ")";
  }
  return "ATen ops: amp's float8 kernels were built for sm_" AMP_FP8_KERNEL_ARCHS ", which this device does not "
         "run; configure amp with AMP_CUDA_ARCHITECTURES naming its architecture";
#else
  return "ATen ops: this build of amp has no float8 kernels (no CUDA compiler was found, AMP_CUDA_KERNELS was "
         "OFF, or no architecture of 8.9 or newer was chosen: set AMP_CUDA_ARCHITECTURES)";
#endif
}

}  // namespace amp
