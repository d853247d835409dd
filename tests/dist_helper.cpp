// One rank of distributed_test: data-parallel training over ProcessGroupGloo
// on loopback, with rank 1 alone seeing an overflow at step 2. Gradients are
// averaged either inside the scale_loss guard (the model's scaled gradients,
// as DDP's hooks do) or after it (the unscaled master gradients).
//
//   dist_helper <rank> <world_size> <store_file> <O1|O2> <inside|after> <output_file>
//
// Writes one tensor per step (every parameter flattened, in fp32, after the
// step) and, last, the number of skipped steps.
#include <amp/amp.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include <iostream>

namespace {

// After an overflow every rank's guard dropped the gradients (the step does
// nothing): there is nothing to average then.
void average_gradients(const std::vector<at::Tensor>& params, c10d::Backend& group, int world) {
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    std::vector<at::Tensor> grad{p.grad()};
    group.allreduce(grad)->wait();
    p.grad().div_(world);
  }
}

at::Tensor flat_params(torch::nn::Module& model) {
  std::vector<at::Tensor> parts;
  for (const auto& p : model.parameters()) parts.push_back(p.detach().to(at::kFloat).flatten());
  return torch::cat(parts);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::cerr << "usage: dist_helper <rank> <world_size> <store_file> <level> <inside|after> <output_file>\n";
    return 2;
  }
  const bool reduce_inside_guard = std::string(argv[5]) == "inside";
  const int rank = std::stoi(argv[1]), world = std::stoi(argv[2]);
  auto store = c10::make_intrusive<c10d::FileStore>(argv[3], world);
  auto gloo_options = c10d::ProcessGroupGloo::Options::create();
  gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gloo_options);

  torch::manual_seed(3);  // identical replicas
  torch::nn::Sequential model(torch::nn::Linear(6, 16), torch::nn::ReLU(), torch::nn::Linear(16, 2));
  amp::OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.05);
  amp::Options options = std::string(argv[4]);
  options.verbosity = 0;
  options.reduce_overflow = amp::overflow_all_reduce(group);
  std::tie(model, optimizer) = amp::initialize(model, optimizer, options);

  std::vector<at::Tensor> trace;
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(100 + step);
    const auto x = torch::randn({16, 6}), y = torch::randn({16, 2});
    const int64_t rows = 16 / world;
    optimizer->zero_grad();
    {
      amp::scale_loss scaled(torch::mse_loss(model->forward(x.narrow(0, rank * rows, rows)),
                                             y.narrow(0, rank * rows, rows)),
                             optimizer);
      scaled.backward();
      if (rank == 1 && step == 2) {
        model->parameters()[0].grad()[0][0] = std::numeric_limits<float>::infinity();
      }
      if (reduce_inside_guard) average_gradients(model->parameters(), *group, world);
    }
    if (!reduce_inside_guard) average_gradients(amp::master_params(*optimizer), *group, world);
    optimizer->step();
    trace.push_back(flat_params(*model));
  }
  trace.push_back(torch::tensor(amp::skipped_steps(*optimizer)));
  trace.push_back(torch::tensor(amp::loss_scale()));
  torch::save(trace, argv[6]);
  return 0;
}
