#include "fp8/fp8_scaler.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <utility>

namespace amp::detail {
namespace {

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
  const auto options = like.options().dtype(at::kFloat);
  if (scale_.defined()) {  // the model moved: its scaling moves with it
    scale_ = scale_.to(like.device());
    history_ = history_.to(like.device());
    updated_ = updated_.to(like.device());
    return;
  }
  scale_ = at::ones({1}, options);
  history_ = at::zeros({recipe_.amax_history_len}, options);
  updated_ = at::zeros({1}, options);
}

// TE's formula; where amax is 0 or not finite the scale stays `otherwise`.
at::Tensor Fp8Scaler::scale_from(const at::Tensor& amax, const at::Tensor& otherwise) const {
  const at::Tensor fresh = (fp8_max_ / amax) / std::ldexp(1.0, recipe_.margin);
  return at::where(amax.gt(0).logical_and(amax.isfinite()), fresh, otherwise);
}

std::pair<at::Tensor, at::Tensor> Fp8Scaler::quantize(const at::Tensor& x, bool tally) {
  place(x);
  dirty_ = true;
  const at::Tensor amax = x.abs().max().to(at::kFloat).reshape({1});
  at::Tensor scale;
  if (recipe_.recipe == Options::Fp8Scaling::Recipe::kCurrent) {
    scale = scale_from(amax, scale_);
  } else {
    const at::Tensor slot = history_.narrow(0, 0, 1);
    slot.copy_(at::maximum(slot, amax.nan_to_num(0, 0, 0)));
    scale = at::where(updated_.gt(0), scale_, scale_from(amax, scale_));  // no history yet: current
  }
  at::Tensor scaled = x.to(at::kFloat) * scale;
  const bool counted = tallying_ && tally;
  at::Tensor saturated;
  if (counted) saturated = scaled.abs().gt(fp8_max_).sum();
  const at::Tensor x8 = scaled.clamp_(-fp8_max_, fp8_max_).to(format_);
  if (counted) add_to_tally(x, x8, saturated, amax, scale);
  // amax - amax: 0 where x is finite, NaN where it is not.
  return {x8, (scale.reciprocal() + (amax - amax)).reshape({})};
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

void Fp8Scaler::update() {
  if (!dirty_) return;
  dirty_ = false;
  ++generation_;
  if (tallying_) completed_ = std::exchange(tally_, Fp8Tally{});
  if (recipe_.recipe == Options::Fp8Scaling::Recipe::kCurrent) return;
  const at::Tensor amax = recipe_.amax_compute == Options::Fp8Scaling::Amax::kMax
                              ? history_.max().reshape({1})
                              : history_.narrow(0, 0, 1).clone();
  scale_.copy_(scale_from(amax, scale_));
  updated_.copy_(at::maximum(updated_, amax.gt(0).logical_and(amax.isfinite()).to(at::kFloat)));
  history_.copy_(history_.roll(-1, 0));
  history_.narrow(0, 0, 1).zero_();
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
  scale_ = scale;
  history_ = history;
  updated_ = updated;
}

}  // namespace amp::detail
