#include "optim/unscale_plan.h"

#include <ATen/ATen.h>

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

}  // namespace

UnscalePlan::UnscalePlan(std::vector<GradSlot>& slots) {
  for (GradSlot& slot : slots) {
    at::Tensor fresh = slot.param.grad();
    at::Tensor aside = slot.aside_reduced ? at::Tensor() : slot.aside;
    if (!fresh.defined() && !aside.defined()) continue;  // no gradient at all
    items_.push_back({&slot, std::move(fresh), std::move(aside), {}});
  }
}

void UnscalePlan::run(const Unscale& unscale) {
  // 1. Results from fresh gradients: copies in the slot's gradient dtype of
  //    low-precision scratch gradients, the new .grad itself otherwise;
  //    asides alone stand in for slots without one (copied when they will be
  //    unscaled in place).
  std::vector<at::Tensor> copy_dst, copy_src;
  for (Item& item : items_) {
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
  add_asides(items_, [&](const Item& item) { return joins(item, /*scaled=*/true); });
  // 3. Unscale (and check) what is scaled. Asides holding true values were
  //    judged by their own guard's verdict; checking them again would make
  //    a guard over several optimizers skip the ones whose gradients are clean.
  if (unscale) {
    std::vector<at::Tensor> scaled;
    for (const Item& item : items_) {
      if (item.fresh.defined() || (item.aside.defined() && item.slot->aside_scaled)) {
        scaled.push_back(item.result);
      }
    }
    unscale(scaled);
  }
  // 4. Asides holding true values join after unscaling.
  add_asides(items_, [&](const Item& item) { return joins(item, /*scaled=*/false); });

  for (Item& item : items_) item.slot->param.mutable_grad() = item.result;
}

}  // namespace amp::detail
