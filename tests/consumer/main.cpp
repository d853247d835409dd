// SPDX-License-Identifier: BSD-3-Clause
// Trains a few steps at O2 through amp as a team's project takes it in
// (find_package, FetchContent or add_subdirectory): proves the headers, the
// library and the way in work from outside amp's own build, and that the
// loss falls.
#include <amp/amp.h>

#include <torch/torch.h>

#include <cstring>
#include <iostream>

int main() {
  torch::manual_seed(0);
  const auto x = torch::randn({64, 8});
  const auto y = x.matmul(torch::randn({8, 2}));
  torch::nn::Linear model(8, 2);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  amp::Options options = amp::O2;
  options.verbosity = 0;
  amp::initialize(model, optimizer, options);
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model(x), y);
    (step == 0 ? first : last) = loss.item<double>();
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
  // O2: the masters rest in float32 between iterations; the loss fell.
  const bool ok = model->weight.scalar_type() == at::kFloat && last < 0.5 * first &&
                  std::strcmp(amp::version(), AMP_VERSION_STRING) == 0;
  std::cout << (ok ? "consumer ok" : "consumer FAILED") << ": amp " << amp::version() << ", O2 loss " << first
            << " -> " << last << " in 20 steps, weight dtype " << model->weight.scalar_type() << "\n";
  return ok ? 0 : 1;
}
