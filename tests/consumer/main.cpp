// SPDX-License-Identifier: BSD-3-Clause
// Trains two steps through an installed amp: proves headers, library and
// find_package(amp) work from outside the source tree.
#include <amp/amp.h>

#include <torch/torch.h>

#include <iostream>

int main() {
  torch::nn::Linear model(4, 2);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  amp::Options options = amp::O2;
  options.verbosity = 0;
  amp::initialize(model, optimizer, options);
  const auto before = model->weight.detach().clone();
  for (int step = 0; step < 2; ++step) {
    optimizer.zero_grad();
    auto loss = model(torch::randn({8, 4})).pow(2).mean();
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
  // O2: the masters rest in float32 between iterations, and they moved.
  const bool ok = model->weight.scalar_type() == at::kFloat && !torch::equal(before, model->weight);
  std::cout << (ok ? "consumer ok" : "consumer FAILED") << ": weight dtype " << model->weight.scalar_type() << "\n";
  return ok ? 0 : 1;
}
