// SPDX-License-Identifier: BSD-3-Clause
// Data-parallel training of the Fashion-MNIST CNN with amp on several
// processes over LibTorch's c10d. One command starts every rank on this
// machine (ProcessGroupGloo on loopback):
//
//   distributed_fashion_mnist --world_size=2 --opt_level=O2
//   distributed_fashion_mnist --world_size=4 --opt_level=O2 --shard
//   distributed_fashion_mnist --world_size=4 --opt_level=O6 --shard --shard_weights
//   distributed_fashion_mnist --world_size=4 --opt_level=O2 --compare_steps=100
//
// or a launcher starts one process a rank, on any number of machines, and
// each joins through a TCPStore (common/launch.h; docs/guide.md, "Beyond one
// machine"):
//
//   torchrun --nnodes=2 --nproc_per_node=4 --node_rank=0 --master_addr=node0 --master_port=29500 \
//     --no-python distributed_fashion_mnist --opt_level=O2 --shard --checkpoint_dir=/shared/run
//   srun --ntasks=8 --ntasks-per-node=4 distributed_fashion_mnist --opt_level=O2 --shard
//
// Each rank trains on its own part of every batch. The loop is the one of a
// single process: amp, given the process group (Options::data_parallel),
// starts from rank 0's weights, averages the gradients in buckets while
// backward runs, and every rank skips the same steps. With --shard each rank
// keeps 1/world_size of the float32 masters, Adam's state and the gradients
// (printed, measured); --shard_weights the weights too. --checkpoint_dir
// saves amp's checkpoint every --checkpoint_every steps, and a run (or a
// launcher's restart) resumes from the latest - at any world size.
// --compare_steps times the replicated, sharded and hand-written all-reduce
// loops side by side instead of training.
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include "common/fashion_mnist_data.h"
#include "common/fashion_mnist_net.h"
#include "common/launch.h"
#include "common/step_trace.h"
#include "common/run_setup.h"

#include <absl/flags/flag.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <thread>

extern char** environ;

ABSL_FLAG(int, world_size, 2, "number of processes (ranks) to start on this machine; with --master_addr, "
          "the job's (a launcher's environment sets it otherwise)");
ABSL_FLAG(int, rank, -1, "with --master_addr: this process's rank; else set for the ranks this program starts");
ABSL_FLAG(std::string, store, "", "rendezvous file of the ranks this program starts (default: a fresh file in /tmp)");
ABSL_FLAG(std::string, master_addr, "", "join a job by hand: the host of rank 0's TCPStore (with --rank, "
          "--world_size, --master_port); torchrun and srun set it in the environment instead");
ABSL_FLAG(int, master_port, 29500, "with --master_addr: the TCPStore's port");
ABSL_FLAG(std::string, device, "cpu", "cpu (Gloo) or cuda (NCCL; each rank the GPU of its local rank)");
ABSL_FLAG(int, timeout_s, 120, "seconds any rendezvous or collective waits before it fails (a lost rank)");
ABSL_FLAG(bool, shard_weights, false, "with --shard: the weights too (ZeRO-3)");
ABSL_FLAG(std::string, checkpoint_dir, "", "save amp's checkpoint there every --checkpoint_every steps, and "
          "resume from the latest one found (a directory every rank reads)");
ABSL_FLAG(int, checkpoint_every, 10, "steps between checkpoints, with --checkpoint_dir");
ABSL_FLAG(int, steps, 0, "stop after this many steps in all (0: train --epochs)");
ABSL_FLAG(std::string, save_weights, "", "write the trained float32 weights to this file (amp::save_fp32_weights)");
ABSL_FLAG(std::string, kill_rank_at_step, "", "RANK:STEP - that rank kills itself (SIGKILL) before STEP in the "
          "launcher's first attempt: a lost rank, to try recovery with");
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

// The ranks this program started meet through a file on this machine.
c10::intrusive_ptr<c10d::Backend> connect_spawned(int rank, int world, const c10::intrusive_ptr<c10d::Store>& store) {
  auto gloo = c10d::ProcessGroupGloo::Options::create();
  gloo->threads = absl::GetFlag(FLAGS_gloo_threads);
  gloo->timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
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

// The latest complete checkpoint in `dir` ("step-N.pt", written atomically
// by amp::save_checkpoint) and its step; {"", 0} when there is none.
std::pair<std::string, int64_t> latest_checkpoint(const std::string& dir) {
  std::pair<std::string, int64_t> latest{"", 0};
  if (dir.empty() || !std::filesystem::is_directory(dir)) return latest;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    long long step = 0;
    char tail = 0;
    if (std::sscanf(name.c_str(), "step-%lld.p%c", &step, &tail) == 2 && tail == 't' && name == "step-" + std::to_string(step) + ".pt" &&
        step > latest.second) {
      latest = {entry.path().string(), step};
    }
  }
  return latest;
}

// --kill_rank_at_step RANK:STEP as {rank, step}; {-1, -1} when unset.
std::pair<int, int64_t> kill_point() {
  const std::string flag = absl::GetFlag(FLAGS_kill_rank_at_step);
  if (flag.empty()) return {-1, -1};
  int rank = -1;
  long long step = -1;
  if (std::sscanf(flag.c_str(), "%d:%lld", &rank, &step) != 2 || rank < 0 || step < 0) {
    throw std::invalid_argument("--kill_rank_at_step takes RANK:STEP, got '" + flag + "'");
  }
  return {rank, step};
}

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// A rank whose training failed asks which ranks are still there: each that
// fails says so in the job's store and waits, up to --timeout_s, for the
// others to say so too. A rank that never does is lost (it died: the group
// is broken); this rank names it and ends at once - nothing collective (a
// checkpoint, amp::deinitialize) can run any more, and a launcher restarts
// the job, which resumes from the last complete checkpoint. Where every rank
// answers, the error is not a lost rank's: rethrown.
int train(int rank, int world, const c10::intrusive_ptr<c10d::Backend>& group, int restart_count, c10::Device device);

std::vector<int> ranks_lost(c10d::Store& store, int rank, int world) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
  auto key = [](int r) { return "amp_example/failed/" + std::to_string(r); };
  std::vector<int> missing;
  try {
    store.set(key(rank), std::vector<uint8_t>{1});
    for (;;) {
      missing.clear();
      for (int r = 0; r < world; ++r) {
        if (!store.check({key(r)})) missing.push_back(r);
      }
      if (missing.empty() || std::chrono::steady_clock::now() > deadline) return missing;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {  // the store's host is gone: rank 0, or the launcher's agent
    return {0};
  }
}

int train_or_report(int rank, int world, const c10::intrusive_ptr<c10d::Backend>& group, c10d::Store& store,
                    int restart_count, c10::Device device) {
  try {
    return train(rank, world, group, restart_count, device);
  } catch (const c10::Error& error) {  // the group's own (c10::DistBackendError) or amp's, which carry them
    const std::vector<int> lost = ranks_lost(store, rank, world);
    if (lost.empty()) throw;
    std::string names;
    for (int r : lost) names += (names.empty() ? "" : ", ") + std::to_string(r);
    const std::string what = error.what();
    std::fprintf(stderr, "rank %d: training stopped: %s\nrank %d: lost rank %s: no word from it in %d s; the "
                 "process group is broken. Restart the job (torchrun --max-restarts) to resume from the last "
                 "checkpoint.\n", rank, what.substr(0, what.find('\n')).c_str(), rank, names.c_str(),
                 absl::GetFlag(FLAGS_timeout_s));
    std::fflush(nullptr);
    std::_Exit(3);
  }
}

int train(int rank, int world, const c10::intrusive_ptr<c10d::Backend>& group, int restart_count, c10::Device device) {
  // The ranks share this machine's cores: more threads than cores only wait.
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world));

  amp::Options options = examples::amp_options(absl::GetFlag(FLAGS_opt_level), absl::GetFlag(FLAGS_dtype),
                                               device, rank == 0 ? 1 : 0);
  options.data_parallel.group = group;
  options.data_parallel.reduce_dtype = reduce_dtype(absl::GetFlag(FLAGS_reduce_dtype));
  options.data_parallel.shard = absl::GetFlag(FLAGS_shard);
  options.data_parallel.shard_weights = absl::GetFlag(FLAGS_shard_weights);
  auto train_set = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), true,
                                                absl::GetFlag(FLAGS_train_limit));
  train_set.images = train_set.images.to(device);
  train_set.labels = train_set.labels.to(device);
  torch::manual_seed(0);  // identical replicas
  examples::FashionNet model;
  model->to(device);
  const auto adam = make_adam(model);
  torch::optim::Adam& optimizer = *adam;
  amp::initialize(model, optimizer, options);

  // Resuming: the latest complete checkpoint, whatever world size wrote it
  // (each rank takes its part of sharded state).
  const std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  const auto [resume_from, first_step] = latest_checkpoint(checkpoint_dir);
  if (!resume_from.empty()) {
    amp::load_checkpoint(resume_from, {model.ptr()}, {optimizer});
    if (rank == 0) std::printf("resumed from %s (attempt %d)\n", resume_from.c_str(), restart_count);
  }
  if (!checkpoint_dir.empty() && rank == 0) std::filesystem::create_directories(checkpoint_dir);
  const auto [kill_rank, kill_step] = kill_point();

  const int64_t n = train_set.images.size(0), batch = absl::GetFlag(FLAGS_batch_size);
  const int64_t per_epoch = n / batch;
  const int64_t last_step = absl::GetFlag(FLAGS_steps) > 0 ? absl::GetFlag(FLAGS_steps)
                                                            : per_epoch * absl::GetFlag(FLAGS_epochs);
  examples::Progress progress(50);
  examples::StepTrace trace(rank == 0 ? absl::GetFlag(FLAGS_trace) : "", device);
  std::array<double, 3> per_parameter{};
  double first_loss = 0, last_loss = 0;  // the global batch's, averaged over the ranks
  at::Tensor order;
  for (int64_t step = first_step; step < last_step; ++step) {
    // Each epoch's order from a seed of its own: a resumed run draws what an
    // uninterrupted one would, on every rank alike.
    if (step % per_epoch == 0 || !order.defined()) {
      torch::manual_seed(1000 + step / per_epoch);
      order = torch::randperm(n);
    }
    if (rank == kill_rank && step == kill_step && restart_count == 0) raise(SIGKILL);
    trace.at_step(step + 1);
    const auto index = rows_of(order, (step % per_epoch) * batch, batch, rank, world).to(device);
    optimizer.zero_grad();
    const auto loss = torch::cross_entropy_loss(model->forward(train_set.images.index_select(0, index)),
                                                train_set.labels.index_select(0, index));
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    if (step == first_step) per_parameter = bytes_per_parameter(optimizer, *group);  // gradients still held
    if (step == first_step || step + 1 == last_step) {
      std::vector<at::Tensor> sum{loss.detach().to(at::kFloat).reshape({1})};  // NCCL: no float64
      group->allreduce(sum)->wait();
      (step == first_step ? first_loss : last_loss) = sum[0].item<double>() / world;
    }
    if (rank == 0) progress.update(step + 1, loss.item<double>(), amp::loss_scaler()->scale(), batch);
    if (!checkpoint_dir.empty() && (step + 1) % absl::GetFlag(FLAGS_checkpoint_every) == 0) {
      // Every rank takes part (sharded state is gathered); rank 0 writes.
      amp::save_checkpoint(checkpoint_dir + "/step-" + std::to_string(step + 1) + ".pt", {model.ptr()}, {optimizer});
    }
  }
  if (!absl::GetFlag(FLAGS_save_weights).empty()) amp::save_fp32_weights(model.ptr(), absl::GetFlag(FLAGS_save_weights));
  // Every rank evaluates: with --shard after LibTorch's Adam the first
  // forward gathers the weights (a collective); after amp's fused Adam (O6)
  // the step gathered them and rank 0 could evaluate alone.
  const auto test = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), false, absl::GetFlag(FLAGS_test_limit));
  torch::NoGradGuard no_grad;
  model->eval();
  const auto correct =
      model->forward(test.images.to(device)).argmax(1).eq(test.labels.to(device)).sum().item<int64_t>();
  const int64_t skipped = amp::skipped_steps(optimizer);
  // Every rank ends amp before returning: the process group goes with it
  // (a collective with --shard: the optimizer gets its whole state back).
  amp::deinitialize();
  if (rank != 0) return 0;
  progress.finish();
  std::printf("world_size %d  opt_level %s  shard %d  test accuracy %.2f%%  skipped steps %lld  peak RSS %.0f MiB  "
              "peak allocated %.1f MiB (rank 0)\n", world, examples::level_name(options).c_str(),
              options.data_parallel.shard ? (options.data_parallel.shard_weights ? 3 : 2) : 0,
              100.0 * correct / test.images.size(0), static_cast<long long>(skipped), examples::peak_rss_mib(),
              examples::peak_allocated_mib(device));
  std::printf("first loss %.9g (step %lld)  final loss %.9g (step %lld; each the mean over the ranks)\n", first_loss,
              static_cast<long long>(first_step + 1), last_loss, static_cast<long long>(last_step));
  std::printf("bytes per parameter on the fullest rank (measured): masters %.2f  optimizer state %.2f  "
              "gradients %.2f\n", per_parameter[0], per_parameter[1], per_parameter[2]);
  return 0;
}

// --compare_steps: the same steps in three loops, timed side by side.
int compare_loops(int rank, int world, const c10::intrusive_ptr<c10d::Backend>& group) {
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world));
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
  return examples::run_main(argc, argv, "Data-parallel Fashion-MNIST training with amp on several processes.", [&] {
    if (absl::GetFlag(FLAGS_gloo_threads) < 1) throw std::invalid_argument("--gloo_threads must be >= 1");
    if (absl::GetFlag(FLAGS_timeout_s) < 1) throw std::invalid_argument("--timeout_s must be >= 1");
    if (absl::GetFlag(FLAGS_checkpoint_every) < 1) throw std::invalid_argument("--checkpoint_every must be >= 1");
    if (absl::GetFlag(FLAGS_shard_weights) && !absl::GetFlag(FLAGS_shard)) {
      throw std::invalid_argument("--shard_weights needs --shard");
    }
    kill_point();  // checks the flag before any rank starts
    const std::string device_name = absl::GetFlag(FLAGS_device);
    if (device_name != "cpu" && device_name != "cuda") throw std::invalid_argument("--device must be cpu or cuda");
    // Each rank its own GPU: the local rank's (one command: the rank's).
    auto device_of = [&](int local_rank) {
      return device_name == "cuda" ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank))
                                   : c10::Device(c10::kCPU);
    };
    const auto timeout = std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s));
    // A launcher's process (torchrun, srun), or one joining by hand: one rank.
    std::optional<examples::Launch> launch = examples::launch_from_environment();
    if (!launch && !absl::GetFlag(FLAGS_master_addr).empty()) {
      launch = examples::Launch{"flags", absl::GetFlag(FLAGS_rank), absl::GetFlag(FLAGS_world_size),
                                std::max(0, absl::GetFlag(FLAGS_rank)), absl::GetFlag(FLAGS_master_addr),
                                absl::GetFlag(FLAGS_master_port)};
    }
    if (launch) {
      if (absl::GetFlag(FLAGS_batch_size) % launch->world_size != 0) {
        throw std::invalid_argument("--batch_size must be a multiple of the world size " +
                                    std::to_string(launch->world_size));
      }
      const c10::Device device = device_of(launch->local_rank);
      const auto connection = examples::connect(*launch, device, timeout, absl::GetFlag(FLAGS_gloo_threads));
      if (launch->rank == 0) {
        std::printf("%s: rank 0 of %d, rendezvous at %s:%d\n", launch->launcher.c_str(), launch->world_size,
                    launch->master_addr.c_str(), launch->master_port);
      }
      return absl::GetFlag(FLAGS_compare_steps) > 0
                 ? compare_loops(launch->rank, launch->world_size, connection.group)
                 : train_or_report(launch->rank, launch->world_size, connection.group, *connection.store,
                                   launch->restart_count, device);
    }
    // One command: this process starts the other ranks on this machine.
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
    if (device_name == "cuda") throw std::invalid_argument("--device=cuda needs a launcher (torchrun, srun): NCCL");
    auto file_store = c10::make_intrusive<c10d::FileStore>(store, world);
    const auto group = connect_spawned(rank, world, file_store);
    int rc = absl::GetFlag(FLAGS_compare_steps) > 0 ? compare_loops(rank, world, group)
                                                    : train_or_report(rank, world, group, *file_store, 0, device_of(rank));
    for (pid_t pid : others) {
      int status = 0;
      waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
    }
    if (rank == 0) unlink(store.c_str());
    return rc;
  });
}
