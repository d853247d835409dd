// SPDX-License-Identifier: BSD-3-Clause
#include "gradient_check.h"

namespace examples {

double relative_gradient_error(torch::optim::Optimizer& optimizer, const torch::nn::Module& reference) {
  const auto weights = amp::master_params(optimizer);
  const auto params = reference.parameters();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor want = params[i].grad();
    if (!want.defined()) continue;
    const at::Tensor got = weights[i].grad();
    TORCH_CHECK(got.defined(), "gradient check: parameter ", i, " has a reference gradient but amp gave none");
    diff += (got.to(torch::kDouble) - want).pow(2).sum().item<double>();
    norm += want.pow(2).sum().item<double>();
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

}  // namespace examples
