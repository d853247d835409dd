#include "step/non_finite_check.h"

#include "step/overflow_verdict.h"

#include <ATen/ATen.h>

#include <map>
#include <tuple>

namespace amp::detail {

void non_finite_check_and_unscale(const std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                                  const at::Tensor& inv_scale) {
  std::map<std::tuple<int, int, int>, std::vector<at::Tensor>> groups;  // (device, index, dtype)
  auto add = [&](const at::Tensor& t) {
    groups[{static_cast<int>(t.device().type()), t.device().index(),
            static_cast<int>(t.scalar_type())}].push_back(t);
  };
  for (const auto& g : grads) {
    if (!g.is_sparse()) {
      add(g);
      continue;
    }
    // Sparse (nn::Embedding with sparse=true): unscale the values in place.
    // Duplicate indices are summed when the gradient is used; in float16 the
    // sums can overflow where no value does, so GradScaler checks them too
    // (here on a coalesced copy, unscaled and dropped).
    add(g._values());
    if (g.scalar_type() == at::kHalf && !g.is_coalesced()) add(g.coalesce()._values());
  }
  const c10::Device home = found_inf.device();
  for (auto& [key, group] : groups) {
    const c10::Device device = group.front().device();
    if (device == home) {
      at::_amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale);
    } else {  // model parallel: check on the gradients' device, fold into found_inf
      at::Tensor found_here = at::zeros({1}, found_inf.options().device(device));
      at::_amp_foreach_non_finite_check_and_unscale_(group, found_here, inv_scale.to(device));
      found_inf.add_(found_here.to(home));
      // Into a CPU flag (the loss was on the CPU) the copy waits for the
      // device: a host sync like any other.
      if (home.is_cpu() && !device.is_cpu()) count_host_read();
    }
  }
}

}  // namespace amp::detail
