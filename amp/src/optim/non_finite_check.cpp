// SPDX-License-Identifier: BSD-3-Clause
#include "optim/non_finite_check.h"

#include "support/host_read.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

namespace amp::detail {

void check_and_unscale_by_max(const std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                              const at::Tensor& inv_scale) {
  // The largest magnitude of a gradient is inf or NaN exactly when one of its
  // values is (max propagates NaN, and cannot overflow as a sum would); the
  // float32 maxima go through ATen's check. The multiply is float32 times
  // float32, rounded once, as ATen's kernel does: a 0-dim factor would be
  // rounded to bfloat16 first, so it is expanded to take part in promotion.
  const std::vector<at::Tensor> maxima = at::_foreach_norm(grads, INFINITY, at::kFloat);
  std::vector<at::Tensor> stacked{at::stack(maxima)};
  at::_amp_foreach_non_finite_check_and_unscale_(stacked, found_inf, inv_scale);
  const at::Tensor factor = inv_scale.reshape({});
  for (const at::Tensor& g : grads) g.mul_(factor.expand(g.sizes()));
}

namespace {

// ATen's CUDA kernel covers float32 and float16 only (AmpKernels.cu), while
// O5/O6 and bfloat16 shards hand it bfloat16 gradients.
void check_and_unscale(const std::vector<at::Tensor>& grads, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  const at::Tensor& first = grads.front();
  if (first.is_cuda() && first.scalar_type() == at::kBFloat16) {
    check_and_unscale_by_max(grads, found_inf, inv_scale);
  } else {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
  }
}

}  // namespace

void non_finite_check_and_unscale(const std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                                  const at::Tensor& inv_scale) {
  if (grads.empty()) return;
  // The usual case, without grouping: dense gradients of one dtype on the flag's device.
  const at::Tensor& first = grads.front();
  const bool one_group = std::all_of(grads.begin(), grads.end(), [&](const at::Tensor& g) {
    return !g.is_sparse() && g.device() == found_inf.device() && g.scalar_type() == first.scalar_type();
  });
  if (one_group) {
    check_and_unscale(grads, found_inf, inv_scale);
    return;
  }
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
      check_and_unscale(group, found_inf, inv_scale);
    } else {  // model parallel: check on the gradients' device, fold into found_inf
      at::Tensor found_here = at::zeros({1}, found_inf.options().device(device));
      check_and_unscale(group, found_here, inv_scale.to(device));
      found_inf.add_(found_here.to(home));
      // Into a CPU flag (the loss was on the CPU) the copy waits for the
      // device: a host sync like any other.
      if (home.is_cpu() && !device.is_cpu()) count_host_read();
    }
  }
}

}  // namespace amp::detail
