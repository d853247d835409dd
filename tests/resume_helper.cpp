// SPDX-License-Identifier: BSD-3-Clause
// Helper process for checkpoint_process_test: trains, saves or resumes in a
// process of its own, so resuming starts from nothing but the file.
//
//   resume_helper <O0..O5> full   <out>               8 steps straight through
//   resume_helper <O0..O5> save   <checkpoint>        steps 0-3, then save
//   resume_helper <O0..O5> resume <checkpoint> <out>  load, then steps 4-7
//   resume_helper O2 save_forever <checkpoint>        a 48 MB checkpoint of a
//     Linear(2048, 2048) with Adam, written over and over until killed
//
// (LibTorch's Adam steps: every level but O6, which steps only amp's fused
// optimizers.)
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include <torch/torch.h>

#include <iostream>

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() : a(register_module("a", torch::nn::Linear(6, 16))), bn(register_module("bn", torch::nn::BatchNorm1d(16))),
              b(register_module("b", torch::nn::Linear(16, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(bn(a(x)))); }
  torch::nn::Linear a;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear b;
};
TORCH_MODULE(Net);

void train_steps(Net& model, std::shared_ptr<torch::optim::Optimizer>& optimizer, int first, int last) {
  for (int step = first; step < last; ++step) {
    torch::manual_seed(500 + step);
    const auto x = torch::randn({8, 6}), y = torch::randn({8, 2});
    optimizer->zero_grad();
    {
      amp::scale_loss scaled(torch::mse_loss(model->forward(x), y), optimizer);
      scaled.backward();
      if (step == 2) model->a->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
    }
    optimizer->step();
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: resume_helper <level> full|save|resume <path> [out]\n";
    return 2;
  }
  const std::string phase = argv[2], path = argv[3];
  if (phase == "save_forever") {  // checkpoint_test kills it mid-write
    torch::manual_seed(1);
    torch::nn::Linear big(2048, 2048);
    torch::optim::Adam adam(big->parameters(), 1e-3);
    amp::Options options = std::string(argv[1]);
    options.verbosity = 0;
    amp::initialize(big, adam, options);
    for (int64_t step = 0;; ++step) {
      adam.zero_grad();
      {
        amp::scale_loss scaled(big(torch::randn({4, 2048})).pow(2).mean(), adam);
        scaled.backward();
      }
      adam.step();
      amp::save_checkpoint(path, {big.ptr()}, {adam});
    }
  }
  torch::manual_seed(phase == "resume" ? 99 : 1);  // resume starts from other weights
  Net model;
  std::shared_ptr<torch::optim::Optimizer> optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-2);
  amp::Options options = std::string(argv[1]);
  options.verbosity = 0;
  options.loss_scale = amp::LossScale::Dynamic(256.0);
  options.dynamic_scaling.growth_interval = 2;
  std::tie(model, optimizer) = amp::initialize(model, optimizer, options);
  if (phase == "save") {
    train_steps(model, optimizer, 0, 4);
    amp::save_checkpoint(path, {model.ptr()}, {optimizer});
    return 0;
  }
  if (phase == "resume") amp::load_checkpoint(path, {model.ptr()}, {optimizer});
  train_steps(model, optimizer, phase == "resume" ? 4 : 0, 8);
  std::vector<torch::Tensor> result;
  for (const auto& p : model->parameters()) result.push_back(p.detach());
  for (const auto& b : model->buffers()) result.push_back(b.detach());
  for (const auto& m : amp::master_params(*optimizer)) result.push_back(m.detach());
  result.push_back(torch::tensor(amp::loss_scaler()->scale()));
  result.push_back(torch::tensor(amp::loss_scaler()->growth_tracker()));
  torch::save(result, argc > 4 ? argv[4] : path);
  return 0;
}
