// Trains two steps through an installed amp: proves headers, library and
// find_package(amp) work from outside the source tree.
#include <amp/amp.h>

#include <torch/torch.h>

#include <iostream>

int main() {
  auto model = torch::nn::Linear(4, 2);
  std::shared_ptr<torch::optim::Optimizer> optimizer =
      std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  amp::Options options = amp::O2;
  options.verbosity = 0;
  std::tie(model, optimizer) = amp::initialize(model, optimizer, options);
  for (int step = 0; step < 2; ++step) {
    optimizer->zero_grad();
    auto loss = model(torch::randn({8, 4})).pow(2).mean();
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer->step();
  }
  std::cout << "consumer ok: weight dtype " << model->weight.scalar_type() << "\n";
  return model->weight.scalar_type() == at::kBFloat16 ? 0 : 1;
}
