// Data-parallel training of the Fashion-MNIST CNN with amp on several
// processes over LibTorch's c10d (ProcessGroupGloo on loopback). One command
// starts every rank:
//
//   distributed_fashion_mnist --world_size=2 --opt_level=O2
//
// Each rank trains on its own part of every batch. The loop is the one of a
// single process: amp, given the process group (Options::data_parallel),
// starts from rank 0's weights, averages the gradients in buckets while
// backward runs, and every rank skips the same steps.
#include <amp/amp.h>

#include "common/fashion_mnist_data.h"
#include "common/fashion_mnist_net.h"
#include "common/run_setup.h"

#include <absl/flags/flag.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <thread>

extern char** environ;

ABSL_FLAG(int, world_size, 2, "number of processes (ranks) to run");
ABSL_FLAG(int, rank, -1, "set by the launcher for the ranks it starts; leave unset");
ABSL_FLAG(std::string, store, "", "rendezvous file (default: a fresh file in /tmp)");
ABSL_FLAG(std::string, opt_level, "O1", "amp opt level");
ABSL_FLAG(std::string, dtype, "", "fp16 or bf16");
ABSL_FLAG(std::string, reduce_dtype, "fp32", "dtype gradients travel in: fp32, fp16 or bf16");
ABSL_FLAG(int, epochs, 1, "training epochs");
ABSL_FLAG(int, batch_size, 128, "global batch size (split across ranks)");
ABSL_FLAG(double, lr, 2e-3, "Adam learning rate");
ABSL_FLAG(int64_t, train_limit, 0, "use only the first N training images (0: all)");
ABSL_FLAG(int64_t, test_limit, 0, "use only the first N test images (0: all)");
ABSL_FLAG(std::string, data_dir, examples::kDefaultFashionMnistDir, "Fashion-MNIST directory");

namespace {

// Starts ranks 1..world-1 as copies of this program; returns their pids.
std::vector<pid_t> launch_other_ranks(int argc, char** argv, int world, const std::string& store) {
  std::vector<pid_t> pids;
  for (int rank = 1; rank < world; ++rank) {
    std::vector<std::string> args(argv, argv + argc);
    args.push_back("--rank=" + std::to_string(rank));
    args.push_back("--store=" + store);
    std::vector<char*> raw;
    for (auto& a : args) raw.push_back(a.data());
    raw.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, raw.data(), environ) != 0) {
      throw std::runtime_error("cannot start rank " + std::to_string(rank));
    }
    pids.push_back(pid);
  }
  return pids;
}

c10::ScalarType reduce_dtype(const std::string& name) {
  if (name == "fp32") return c10::kFloat;
  if (name == "fp16") return c10::kHalf;
  if (name == "bf16") return c10::kBFloat16;
  throw std::invalid_argument("--reduce_dtype must be fp32, fp16 or bf16, got '" + name + "'");
}

int train(int rank, int world, const std::string& store_path) {
  // The ranks share this machine's cores: more threads than cores only wait.
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world));
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world);
  auto gloo = c10d::ProcessGroupGloo::Options::create();
  gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gloo);

  amp::Options options = examples::amp_options(absl::GetFlag(FLAGS_opt_level), absl::GetFlag(FLAGS_dtype),
                                               c10::Device(c10::kCPU), rank == 0 ? 1 : 0);
  options.data_parallel.group = group;
  options.data_parallel.reduce_dtype = reduce_dtype(absl::GetFlag(FLAGS_reduce_dtype));
  const auto train_set = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), true,
                                                      absl::GetFlag(FLAGS_train_limit));
  torch::manual_seed(0);  // identical replicas
  examples::FashionNet model;
  torch::optim::Adam optimizer(model->parameters(), absl::GetFlag(FLAGS_lr));
  amp::initialize(model, optimizer, options);

  const int64_t n = train_set.images.size(0), batch = absl::GetFlag(FLAGS_batch_size);
  examples::Progress progress(50);
  int64_t step = 0;
  for (int epoch = 0; epoch < absl::GetFlag(FLAGS_epochs); ++epoch) {
    const auto order = torch::randperm(n);  // same on every rank (same seed)
    for (int64_t first = 0; first + batch <= n; first += batch) {
      const auto index = order.narrow(0, first, batch).narrow(0, rank * (batch / world), batch / world);
      optimizer.zero_grad();
      const auto loss = torch::cross_entropy_loss(model->forward(train_set.images.index_select(0, index)),
                                                  train_set.labels.index_select(0, index));
      {
        amp::scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      if (rank == 0) progress.update(++step, loss.item<double>(), amp::loss_scale(), batch);
    }
  }
  if (rank != 0) return 0;
  progress.finish();
  const auto test = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), false, absl::GetFlag(FLAGS_test_limit));
  torch::NoGradGuard no_grad;
  model->eval();
  const auto correct = model->forward(test.images).argmax(1).eq(test.labels).sum().item<int64_t>();
  std::printf("world_size %d  opt_level %s  test accuracy %.2f%%  skipped steps %lld\n", world,
              amp::to_string(options.opt_level), 100.0 * correct / test.images.size(0),
              static_cast<long long>(amp::skipped_steps(optimizer)));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::run_main(argc, argv, "Data-parallel Fashion-MNIST training with amp on several local processes.", [&] {
    const int world = absl::GetFlag(FLAGS_world_size);
    if (world < 1 || absl::GetFlag(FLAGS_batch_size) % world != 0) {
      throw std::invalid_argument("--world_size must be >= 1 and divide --batch_size");
    }
    int rank = absl::GetFlag(FLAGS_rank);
    std::string store = absl::GetFlag(FLAGS_store);
    std::vector<pid_t> others;
    if (rank < 0) {  // the launcher is rank 0
      rank = 0;
      if (store.empty()) store = "/tmp/amp_fashion_mnist_store_" + std::to_string(getpid());
      unlink(store.c_str());
      others = launch_other_ranks(argc, argv, world, store);
    }
    int rc = train(rank, world, store);
    for (pid_t pid : others) {
      int status = 0;
      waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
    }
    if (rank == 0) unlink(store.c_str());
    return rc;
  });
}
