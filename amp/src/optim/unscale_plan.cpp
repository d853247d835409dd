// SPDX-License-Identifier: BSD-3-Clause
#include "optim/unscale_plan.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace amp::detail {
namespace {

// dst[i] += src[i] for the items `pick` selects, as one foreach call.
template <class Items, class Pick>
void add_asides(Items& items, Pick pick) {
  std::vector<at::Tensor> dst, src;
  for (auto& item : items) {
    if (!pick(item)) continue;
    dst.push_back(item.result);
    src.push_back(item.aside);
  }
  if (!dst.empty()) at::_foreach_add_(dst, src);
}

// Slices of the gradients that are copied into another dtype: each slice's
// scratch gradients are freed once its results exist, so the guard holds
// the float32 gradients plus an eighth of the scratch ones at most, not
// both whole (O2/O5's peak, 2 bytes a parameter).
constexpr int64_t kSlices = 8;
constexpr int64_t kMinSliceBytes = int64_t{1} << 20;

}  // namespace

UnscalePlan::UnscalePlan(std::vector<GradSlot>& slots) {
  items_.reserve(slots.size());
  for (GradSlot& slot : slots) {
    at::Tensor fresh = slot.param.grad();
    at::Tensor aside = slot.aside_reduced ? at::Tensor() : slot.aside;
    if (!fresh.defined() && !aside.defined()) continue;  // no gradient at all
    items_.push_back({&slot, std::move(fresh), std::move(aside), {}});
  }
}

void UnscalePlan::run(const Unscale& unscale) {
  auto copied_bytes = [](const Item& item) -> int64_t {
    const at::Tensor& fresh = item.fresh;
    if (!fresh.defined() || fresh.scalar_type() == item.slot->grad_dtype) return 0;
    return fresh.numel() * static_cast<int64_t>(c10::elementSize(item.slot->grad_dtype));
  };
  int64_t total = 0;
  for (const Item& item : items_) total += copied_bytes(item);
  const int64_t slice_bytes = std::max(kMinSliceBytes, total / kSlices);
  size_t first = 0;
  int64_t bytes = 0;
  for (size_t i = 0; i < items_.size(); ++i) {
    bytes += copied_bytes(items_[i]);
    if (bytes >= slice_bytes || i + 1 == items_.size()) {
      run_slice({items_.data() + first, items_.data() + i + 1}, unscale);
      first = i + 1;
      bytes = 0;
    }
  }
}

void UnscalePlan::run_slice(Slice items, const Unscale& unscale) {
  // 1. Results from fresh gradients: copies in the slot's gradient dtype of
  //    low-precision scratch gradients, the new .grad itself otherwise;
  //    asides alone stand in for slots without one (copied when they will be
  //    unscaled in place).
  const size_t count = static_cast<size_t>(items.end() - items.begin());
  std::vector<at::Tensor> copy_dst, copy_src;
  for (Item& item : items) {
    const GradSlot& s = *item.slot;
    if (!item.fresh.defined()) {
      item.result = unscale && s.aside_scaled ? item.aside.clone() : item.aside;
    } else if (item.fresh.scalar_type() != s.grad_dtype) {
      item.result = at::empty_like(item.fresh, item.fresh.options().dtype(s.grad_dtype),
                                   at::MemoryFormat::Preserve);
      copy_dst.push_back(item.result);
      copy_src.push_back(item.fresh);
    } else {
      item.result = item.fresh;
    }
  }
  if (!copy_dst.empty()) at::_foreach_copy_(copy_dst, copy_src);

  auto joins = [](const Item& item, bool scaled) {
    return item.fresh.defined() && item.aside.defined() && item.slot->aside_scaled == scaled;
  };
  // 2. Asides still scaled join before unscaling.
  add_asides(items, [&](const Item& item) { return joins(item, /*scaled=*/true); });
  // 3. Unscale (and check) what is scaled. Asides holding true values were
  //    judged by their own guard's verdict; checking them again would make
  //    a guard over several optimizers skip the ones whose gradients are clean.
  if (unscale) {
    std::vector<at::Tensor> scaled;
    scaled.reserve(count);
    for (const Item& item : items) {
      if (item.fresh.defined() || (item.aside.defined() && item.slot->aside_scaled)) {
        scaled.push_back(item.result);
      }
    }
    unscale(scaled);
  }
  // 4. Asides holding true values join after unscaling.
  add_asides(items, [&](const Item& item) { return joins(item, /*scaled=*/false); });

  // The results replace the scratch gradients, which are freed here.
  for (Item& item : items) {
    item.slot->param.mutable_grad() = item.result;
    item.fresh = at::Tensor();
  }
}

}  // namespace amp::detail
