// SPDX-License-Identifier: BSD-3-Clause
// Data-parallel training of the Fashion-MNIST CNN with amp on several
// processes over LibTorch's c10d (ProcessGroupGloo on loopback). One command
// starts every rank:
//
//   distributed_fashion_mnist --world_size=2 --opt_level=O2
//   distributed_fashion_mnist --world_size=4 --opt_level=O2 --shard
//   distributed_fashion_mnist --world_size=4 --opt_level=O6 --shard
//   distributed_fashion_mnist --world_size=4 --opt_level=O2 --compare_steps=100
//
// Each rank trains on its own part of every batch. The loop is the one of a
// single process: amp, given the process group (Options::data_parallel),
// starts from rank 0's weights, averages the gradients in buckets while
// backward runs, and every rank skips the same steps. With --shard each rank
// keeps 1/world_size of the float32 masters, Adam's state and the gradients
// (printed, measured). --compare_steps times the replicated, sharded and
// hand-written all-reduce loops side by side instead of training.
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include "common/fashion_mnist_data.h"
#include "common/fashion_mnist_net.h"
#include "common/step_trace.h"
#include "common/run_setup.h"

#include <absl/flags/flag.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <iostream>
#include <memory>
#include <thread>

extern char** environ;

ABSL_FLAG(int, world_size, 2, "number of processes (ranks) to run");
ABSL_FLAG(int, rank, -1, "set by the launcher for the ranks it starts; leave unset");
ABSL_FLAG(std::string, store, "", "rendezvous file (default: a fresh file in /tmp)");
ABSL_FLAG(std::string, opt_level, "O1", "amp opt level");
ABSL_FLAG(std::string, dtype, "", "fp16 or bf16");
ABSL_FLAG(std::string, reduce_dtype, "fp32", "dtype gradients travel in: fp32, fp16 or bf16");
ABSL_FLAG(bool, shard, false, "spread fp32 masters (O2/O5; O6: the bf16 weights' steps), optimizer state and gradients over the ranks");
ABSL_FLAG(int, compare_steps, 0, "instead of training: time this many steps of each loop (replicated, "
          "sharded, hand-written all-reduce) and print a table");
ABSL_FLAG(int, compare_rounds, 3, "with --compare_steps: rounds of the three loops in turn; each loop's fastest round counts");
ABSL_FLAG(int, gloo_threads, 2, "Gloo's worker threads per rank (Gloo's default: 2); the ranks here share "
          "this machine's cores, where 1 measured faster (BENCHMARKS.md)");
ABSL_FLAG(int, epochs, 1, "training epochs");
ABSL_FLAG(int, batch_size, 128, "global batch size (split across ranks)");
ABSL_FLAG(double, lr, 2e-3, "Adam learning rate");
ABSL_FLAG(int64_t, train_limit, 0, "use only the first N training images (0: all)");
ABSL_FLAG(int64_t, test_limit, 0, "use only the first N test images (0: all)");
ABSL_FLAG(std::string, trace, "", "write a Chrome trace of rank 0's training steps 3-5 (LibTorch's profiler) to this file");
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

c10::intrusive_ptr<c10d::ProcessGroupGloo> connect(int rank, int world, const std::string& store_path) {
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world);
  auto gloo = c10d::ProcessGroupGloo::Options::create();
  gloo->threads = absl::GetFlag(FLAGS_gloo_threads);
  gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gloo);
}

// This rank's rows of batch `first` of `order`.
at::Tensor rows_of(const at::Tensor& order, int64_t first, int64_t batch, int rank, int world) {
  return order.narrow(0, first, batch).narrow(0, rank * (batch / world), batch / world);
}

// The largest of every rank's bytes per parameter (masters, optimizer state,
// gradients), measured by amp::training_bytes after a step.
std::array<double, 3> bytes_per_parameter(torch::optim::Optimizer& optimizer, c10d::Backend& group) {
  const amp::TrainingBytes bytes = amp::training_bytes(optimizer);
  std::vector<at::Tensor> most{torch::tensor({double(bytes.masters), double(bytes.optimizer_state),
                                              double(bytes.gradients)}) / double(bytes.parameters)};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  group.allreduce(most, max)->wait();
  return {most[0][0].item<double>(), most[0][1].item<double>(), most[0][2].item<double>()};
}

// Adam; at O6 amp's fused Adam, which rounds its updates into the bfloat16
// weights stochastically (the same options and state).
std::unique_ptr<torch::optim::Adam> make_adam(examples::FashionNet& model) {
  const torch::optim::AdamOptions options(absl::GetFlag(FLAGS_lr));
  if (absl::GetFlag(FLAGS_opt_level) == "O6") return std::make_unique<amp::optim::FusedAdam>(model->parameters(), options);
  return std::make_unique<torch::optim::Adam>(model->parameters(), options);
}

int train(int rank, int world, const std::string& store_path) {
  // The ranks share this machine's cores: more threads than cores only wait.
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world));
  auto group = connect(rank, world, store_path);

  amp::Options options = examples::amp_options(absl::GetFlag(FLAGS_opt_level), absl::GetFlag(FLAGS_dtype),
                                               c10::Device(c10::kCPU), rank == 0 ? 1 : 0);
  options.data_parallel.group = group;
  options.data_parallel.reduce_dtype = reduce_dtype(absl::GetFlag(FLAGS_reduce_dtype));
  options.data_parallel.shard = absl::GetFlag(FLAGS_shard);
  const auto train_set = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), true,
                                                      absl::GetFlag(FLAGS_train_limit));
  torch::manual_seed(0);  // identical replicas
  examples::FashionNet model;
  const auto adam = make_adam(model);
  torch::optim::Adam& optimizer = *adam;
  amp::initialize(model, optimizer, options);

  const int64_t n = train_set.images.size(0), batch = absl::GetFlag(FLAGS_batch_size);
  examples::Progress progress(50);
  examples::StepTrace trace(rank == 0 ? absl::GetFlag(FLAGS_trace) : "", c10::Device(c10::kCPU));
  int64_t step = 0;
  std::array<double, 3> per_parameter{};
  for (int epoch = 0; epoch < absl::GetFlag(FLAGS_epochs); ++epoch) {
    const auto order = torch::randperm(n);  // same on every rank (same seed)
    for (int64_t first = 0; first + batch <= n; first += batch) {
      trace.at_step(step + 1);
      const auto index = rows_of(order, first, batch, rank, world);
      optimizer.zero_grad();
      const auto loss = torch::cross_entropy_loss(model->forward(train_set.images.index_select(0, index)),
                                                  train_set.labels.index_select(0, index));
      {
        amp::scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      if (step == 0) per_parameter = bytes_per_parameter(optimizer, *group);  // gradients still held
      if (rank == 0) progress.update(++step, loss.item<double>(), amp::loss_scaler()->scale(), batch);
      else ++step;
    }
  }
  // Every rank evaluates: with --shard after LibTorch's Adam the first
  // forward gathers the weights (a collective); after amp's fused Adam (O6)
  // the step gathered them and rank 0 could evaluate alone.
  const auto test = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), false, absl::GetFlag(FLAGS_test_limit));
  torch::NoGradGuard no_grad;
  model->eval();
  const auto correct = model->forward(test.images).argmax(1).eq(test.labels).sum().item<int64_t>();
  const int64_t skipped = amp::skipped_steps(optimizer);
  // Every rank ends amp before returning: the process group goes with it
  // (a collective with --shard: the optimizer gets its whole state back).
  amp::deinitialize();
  if (rank != 0) return 0;
  progress.finish();
  std::printf("world_size %d  opt_level %s  shard %d  test accuracy %.2f%%  skipped steps %lld  peak RSS %.0f MiB  "
              "peak allocated %.1f MiB (rank 0)\n", world, examples::level_name(options).c_str(),
              options.data_parallel.shard ? 1 : 0, 100.0 * correct / test.images.size(0),
              static_cast<long long>(skipped), examples::peak_rss_mib(), examples::peak_allocated_mib(c10::kCPU));
  std::printf("bytes per parameter on the fullest rank (measured): masters %.2f  optimizer state %.2f  "
              "gradients %.2f\n", per_parameter[0], per_parameter[1], per_parameter[2]);
  return 0;
}

// --compare_steps: the same steps in three loops, timed side by side.
int compare_loops(int rank, int world, const std::string& store_path) {
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world));
  auto group = connect(rank, world, store_path);
  const auto train_set = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), true,
                                                      absl::GetFlag(FLAGS_train_limit));
  const int steps = absl::GetFlag(FLAGS_compare_steps);
  const int64_t batch = absl::GetFlag(FLAGS_batch_size);
  const char* names[] = {"replicated (data_parallel)", "sharded (data_parallel.shard)", "hand-written all-reduce"};
  // Rounds of the three loops in turn, the fastest round of each counted:
  // what one loop leaves behind (allocations, caches) favours none, and
  // more rounds see more of each loop without the machine's noise.
  const int rounds = absl::GetFlag(FLAGS_compare_rounds);
  if (rounds < 1) throw std::invalid_argument("--compare_rounds must be >= 1");
  std::array<double, 3> seconds{1e9, 1e9, 1e9};
  std::array<std::array<double, 3>, 3> bytes{};
  for (int round = 0; round < rounds; ++round) {
    for (int loop = 0; loop < 3; ++loop) {
      amp::Options options = examples::amp_options(absl::GetFlag(FLAGS_opt_level), absl::GetFlag(FLAGS_dtype),
                                                   c10::Device(c10::kCPU), 0);
      if (loop < 2) {
        options.data_parallel.group = group;
        options.data_parallel.shard = loop == 1;
      } else {
        options.reduce_overflow = amp::overflow_all_reduce(group);
      }
      torch::manual_seed(0);
      examples::FashionNet model;
      const auto adam = make_adam(model);
      torch::optim::Adam& optimizer = *adam;
      amp::Handle handle;
      handle.initialize(model, optimizer, options);
      const auto order = torch::randperm(train_set.images.size(0));
      auto one_step = [&](int64_t s) {
        const auto index = rows_of(order, (s * batch) % (train_set.images.size(0) - batch), batch, rank, world);
        optimizer.zero_grad();
        const auto loss = torch::cross_entropy_loss(model->forward(train_set.images.index_select(0, index)),
                                                    train_set.labels.index_select(0, index));
        {
          amp::scale_loss scaled(loss, optimizer);
          scaled.backward();
        }
        if (loop == 2) {  // the loop a program writes without amp's data parallel
          for (const auto& p : amp::master_params(optimizer)) {
            if (!p.grad().defined()) continue;
            std::vector<at::Tensor> grad{p.grad()};
            group->allreduce(grad)->wait();
            p.grad().div_(world);
          }
        }
        optimizer.step();
      };
      for (int s = 0; s < 3; ++s) one_step(s);  // warm-up
      bytes[loop] = bytes_per_parameter(optimizer, *group);
      group->barrier()->wait();
      const auto start = std::chrono::steady_clock::now();
      for (int s = 3; s < 3 + steps; ++s) one_step(s);
      group->barrier()->wait();
      const double per_step = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
      seconds[loop] = std::min(seconds[loop], per_step);
    }
  }
  if (rank != 0) return 0;
  std::printf("world_size %d  opt_level %s  batch %lld  %d steps each, fastest of %d rounds (Fashion-MNIST CNN, Adam, Gloo on loopback)\n",
              world, absl::GetFlag(FLAGS_opt_level).c_str(), static_cast<long long>(batch), steps, rounds);
  std::printf("%-32s %10s %12s %9s %9s %9s\n", "loop", "ms/step", "vs replicated", "masters", "state", "grads");
  for (int loop = 0; loop < 3; ++loop) {
    std::printf("%-32s %10.2f %12.3f %9.2f %9.2f %9.2f\n", names[loop], 1e3 * seconds[loop], seconds[loop] / seconds[0],
                bytes[loop][0], bytes[loop][1], bytes[loop][2]);
  }
  std::printf("(masters, state, grads: bytes per parameter on the fullest rank, measured by amp::training_bytes)\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::run_main(argc, argv, "Data-parallel Fashion-MNIST training with amp on several local processes.", [&] {
    const int world = absl::GetFlag(FLAGS_world_size);
    if (world < 1 || absl::GetFlag(FLAGS_batch_size) % world != 0) {
      throw std::invalid_argument("--world_size must be >= 1 and divide --batch_size");
    }
    if (absl::GetFlag(FLAGS_gloo_threads) < 1) throw std::invalid_argument("--gloo_threads must be >= 1");
    int rank = absl::GetFlag(FLAGS_rank);
    std::string store = absl::GetFlag(FLAGS_store);
    std::vector<pid_t> others;
    if (rank < 0) {  // the launcher is rank 0
      rank = 0;
      if (store.empty()) store = "/tmp/amp_fashion_mnist_store_" + std::to_string(getpid());
      unlink(store.c_str());
      others = launch_other_ranks(argc, argv, world, store);
    }
    int rc = absl::GetFlag(FLAGS_compare_steps) > 0 ? compare_loops(rank, world, store) : train(rank, world, store);
    for (pid_t pid : others) {
      int status = 0;
      waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
    }
    if (rank == 0) unlink(store.c_str());
    return rc;
  });
}
