// SPDX-License-Identifier: BSD-3-Clause
// One rank of distributed_test: data-parallel training over ProcessGroupGloo
// on loopback (or ProcessGroupNCCL), a global batch of 24 rows split evenly across the ranks, with
// one rank alone seeing an overflow at step 2.
//
//   dist_helper <rank> <world_size> <store_file> <output_file> [key=value ...]
//     level=O1|O2|O5|O6       opt level (O2; O6 with fused_adamw)
//     reduce=builtin|inside|after|local|none
//                             builtin: Options::data_parallel, the loop as in
//                             one process; inside/after: the loop averages
//                             gradients itself, inside the guard (scaled, as
//                             DDP's hooks do) or after it, with
//                             overflow_all_reduce; local: overflow_all_reduce
//                             alone, each rank steps on its own rows; none:
//                             one process, no group (world_size 1) (builtin)
//     optimizer=sgd|adam|adamw|adagrad|rmsprop|fused_adam|fused_adamw|fused_sgd   (sgd)
//     phases=N optimizers=A,B,...
//                             N runs one after another in this process, each
//                             with a new process group (store <store_file>.phase<k>)
//                             and the next optimizer of the list; phase k
//                             writes <output_file>.phase<k> (1)
//     device=cpu|cuda         where the model and the batches live (cpu)
//     shard=0|1               data_parallel.shard (0)
//     shard_gradients=0|1     data_parallel.shard_gradients (1)
//     shard_weights=0|1       data_parallel.shard_weights (ZeRO-3; with shard=1) (0)
//     clip=X                  amp::clip_grad_norm(optimizer, X) before each step (0: none)
//     checkpoint=PATH save_after=K
//                             amp::save_checkpoint after step K
//     resume=0|1              1: amp::load_checkpoint(PATH) first, then steps K+1..4
//     micro_batches=N         gradient accumulation with delay_unscale (1)
//     reduce_dtype=float|half|bfloat16   data_parallel.reduce_dtype (float)
//     bucket_bytes=N          data_parallel.bucket_bytes (64: several buckets)
//     seed_per_rank=0|1       1: rank r builds its weights from seed 3 + r (0:
//                             every rank from seed 3)
//     recompute=0|1           1: forward through amp::recompute_sequential,
//                             each layer but the last recomputed (0)
//     alone_forward=0|1|2     after the steps one more step, then rank 0
//                             alone runs a forward under no_grad while the
//                             others are elsewhere - 1: asleep for 2.5 s;
//                             2: at the program's barrier, as in
//                             `if (rank == 0) evaluate(model); barrier();`,
//                             after which every rank trains one more step -
//                             and writes to <output_file>.alone "same" (its
//                             weights are the masters rounded; 2: "ran"),
//                             "stale", or "error <seconds>: <message>" (0);
//                             2 adds the masters after the last step to
//                             the trace
//     lone=0|1                with alone_forward: 0 leaves rank 0's forward
//                             out (the same program otherwise) (1)
//     gather_timeout_ms=N     data_parallel.gather_timeout (60000)
//     group_timeout_ms=N      the Gloo group's own timeout (1800000)
//     backend=gloo|nccl       the process group (gloo); nccl: device=cuda,
//                             in a build that found NCCL's header (AMP_WITH_NCCL)
//     fp8=0|1                 1: the fp8 property (level=O5) (0)
//     positions=none|first|after
//                             a table [24, 2] added to the output, read
//                             through a view sliced to the batch
//                             (Python's pos[:n]): taken before any other op
//                             of the forward, or after the layers (none)
//     state8=0|1              1: optimizer_state_dtype uint8 (8-bit state) (0)
//     hidden=N                the hidden layer's width (16)
//     evaluate=0|1            1: after each step every rank runs a forward
//                             under no_grad, whose output joins the trace (0)
//     static_scale=0|1        1: the level's own loss scale (O6: static 1),
//                             and no rank overflows (0: a dynamic scale, the
//                             last rank overflowing at step 2)
//     step_in_backward=0|1    Options::step_in_backward (needs static_scale=1) (0)
//
// Writes one tensor per step (every parameter's float32 master flattened,
// after the step), then the number of skipped steps and the final loss scale.
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef AMP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/torch.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

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
  for (const auto& p : model.parameters()) parts.push_back(p.detach().to(at::kFloat).cpu().flatten());
  return torch::cat(parts);
}

torch::nn::Sequential make_model(bool positions, int64_t hidden) {
  torch::nn::Sequential model(torch::nn::Linear(6, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, 2));
  if (positions) model->register_parameter("positions", torch::randn({24, 2}) * 0.1);
  return model;
}

// The float32 masters as the program sees them: amp's float32 weights file
// (gathered from every rank's shard, written by rank 0), loaded into a
// float32 model.
at::Tensor masters_of(const torch::nn::Sequential& model, const std::string& scratch, c10d::Backend& group) {
  amp::save_fp32_weights(model, scratch);
  group.barrier()->wait();
  torch::nn::Sequential fp32 = make_model(model->named_parameters(/*recurse=*/false).contains("positions"),
                                          model->named_parameters()["0.weight"].size(0));
  torch::load(fp32, scratch);
  group.barrier()->wait();
  return flat_params(*fp32);
}

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "half") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  return at::kFloat;
}

}  // namespace

// One training run (every phase of phases=N is one, in this process).
int run(int rank, int world, const std::string& store_path, const std::string& out_path,
        std::map<std::string, std::string> flags) {
  const std::string reduce = flags["reduce"];
  const int micro_batches = std::stoi(flags["micro_batches"]);

  c10::intrusive_ptr<c10d::Backend> group;
  if (reduce != "none" && flags["backend"] == "nccl") {
#ifdef AMP_WITH_NCCL
    group = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::FileStore>(store_path.c_str(), world), rank,
                                                        world);
#else
    std::cerr << "backend=nccl: this build found no nccl.h (AMP_WITH_NCCL)\n";
    return 2;
#endif
  } else if (reduce != "none") {
    auto store = c10::make_intrusive<c10d::FileStore>(store_path.c_str(), world);
    auto gloo_options = c10d::ProcessGroupGloo::Options::create();
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    gloo_options->timeout = std::chrono::milliseconds(std::stoll(flags["group_timeout_ms"]));
    group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gloo_options);
  }

  torch::manual_seed(3 + (flags["seed_per_rank"] == "1" ? rank : 0));
  torch::nn::Sequential model = make_model(flags["positions"] != "none", std::stoll(flags["hidden"]));
  const torch::Device device(flags["device"]);
  model->to(device);
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  if (flags["optimizer"] == "adam") {
    optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-2);
  } else if (flags["optimizer"] == "adamw") {
    optimizer = std::make_shared<torch::optim::AdamW>(model->parameters(),
                                                      torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  } else if (flags["optimizer"] == "adagrad") {
    optimizer = std::make_shared<torch::optim::Adagrad>(model->parameters(), 1e-1);
  } else if (flags["optimizer"] == "rmsprop") {
    optimizer = std::make_shared<torch::optim::RMSprop>(model->parameters(), 1e-2);
  } else if (flags["optimizer"] == "fused_adam") {
    optimizer = std::make_shared<amp::optim::FusedAdam>(model->parameters(), 1e-2);
  } else if (flags["optimizer"] == "fused_sgd") {
    optimizer = std::make_shared<amp::optim::FusedSGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  } else if (flags["optimizer"] == "fused_adamw") {
    optimizer = std::make_shared<amp::optim::FusedAdamW>(model->parameters(),
                                                         torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  } else {
    optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  }
  amp::Options options = flags["level"];
  options.verbosity = 0;
  const bool static_scale = flags["static_scale"] == "1";
  if (!static_scale) options.loss_scale = amp::LossScale::Dynamic();  // O5 too, so that every level skips the overflow
  options.step_in_backward = flags["step_in_backward"] == "1";
  if (flags["fp8"] == "1") options.fp8 = true;
  if (flags["state8"] == "1") options.optimizer_state_dtype = at::kByte;  // 8-bit optimizer state
  if (reduce == "builtin") {
    options.data_parallel.group = group;
    options.data_parallel.reduce_dtype = parse_dtype(flags["reduce_dtype"]);
    options.data_parallel.bucket_bytes = std::stoll(flags["bucket_bytes"]);
    options.data_parallel.shard = flags["shard"] == "1";
    options.data_parallel.shard_gradients = flags["shard_gradients"] == "1";
    options.data_parallel.shard_weights = flags["shard_weights"] == "1";
    options.data_parallel.gather_timeout = std::chrono::milliseconds(std::stoll(flags["gather_timeout_ms"]));
  } else if (reduce != "none") {
    options.reduce_overflow = amp::overflow_all_reduce(group);
  }
  std::tie(model, optimizer) = amp::initialize(model, optimizer, options);
  const bool shard = flags["shard"] == "1";
  const std::string checkpoint = flags["checkpoint"], scratch = store_path + ".weights";
  const int save_after = std::stoi(flags["save_after"]);
  const double clip = std::stod(flags["clip"]);
  auto layers = [&model, recompute = flags["recompute"] == "1"](const at::Tensor& x) {
    return recompute ? amp::recompute_sequential(model, /*segments=*/3, x) : model->forward(x);
  };
  auto forward = [&, positions = flags["positions"]](const at::Tensor& x) {
    if (positions == "none") return layers(x);
    const at::Tensor table = model->named_parameters(/*recurse=*/false)["positions"];
    if (positions == "first") {
      const at::Tensor rows = table.narrow(/*dim=*/0, /*start=*/0, /*length=*/x.size(0));
      return layers(x) + rows;
    }
    const at::Tensor out = layers(x);
    return out + table.narrow(/*dim=*/0, /*start=*/0, /*length=*/x.size(0));
  };
  if (flags["resume"] == "1") amp::load_checkpoint(checkpoint, {model}, {optimizer});

  std::vector<at::Tensor> trace;
  const int64_t rows = 24 / world, micro_rows = rows / micro_batches;
  for (int step = flags["resume"] == "1" ? save_after + 1 : 0; step < 5; ++step) {
    torch::manual_seed(100 + step);
    const auto x = torch::randn({24, 6}).to(device), y = torch::randn({24, 2}).to(device);
    const bool overflow_here = step == 2 && rank == world - 1 && !static_scale;
    optimizer->zero_grad();
    for (int micro = 0; micro < micro_batches; ++micro) {
      const int64_t first = rank * rows + micro * micro_rows;
      auto loss = torch::mse_loss(forward(x.narrow(0, first, micro_rows)), y.narrow(0, first, micro_rows)) /
                  micro_batches;
      const bool last = micro == micro_batches - 1;
      const bool in_grad = reduce == "inside" || reduce == "after";
      if (overflow_here && last && !in_grad) loss = loss * std::numeric_limits<float>::infinity();
      amp::scale_loss scaled(loss, optimizer, {0, /*delay_unscale=*/!last});
      scaled.backward();
      if (overflow_here && last && in_grad) {
        model->parameters()[0].grad()[0][0] = std::numeric_limits<float>::infinity();
      }
      if (reduce == "inside") average_gradients(model->parameters(), *group, world);
    }
    if (reduce == "after") average_gradients(amp::master_params(*optimizer), *group, world);
    if (clip > 0) amp::clip_grad_norm(*optimizer, clip);
    optimizer->step();
    trace.push_back(shard ? masters_of(model, scratch, *group) : flat_params(*model));
    if (flags["evaluate"] == "1") {
      torch::NoGradGuard no_grad;
      trace.push_back(forward(torch::ones({4, 6}).to(device)).to(at::kFloat).cpu().flatten());
    }
    if (step == save_after && flags["resume"] != "1") amp::save_checkpoint(checkpoint, {model}, {optimizer});
  }
  const std::string alone = flags["alone_forward"];
  if (alone != "0") {
    auto train_one_step = [&] {
      optimizer->zero_grad();
      {
        amp::scale_loss scaled(forward(torch::randn({rows, 6}).to(device)).pow(2).mean(), optimizer);
        scaled.backward();
      }
      optimizer->step();
    };
    train_one_step();  // then rank 0 alone runs a forward
    std::string outcome;
    at::Tensor read;
    if (rank == 0 && flags["lone"] == "1") {
      const auto start = std::chrono::steady_clock::now();
      try {
        torch::NoGradGuard no_grad;
        model->forward(torch::ones({4, 6}).to(device));  // draws nothing: the next steps' batches stay
        read = flat_params(*model);
      } catch (const c10::Error& e) {
        std::ostringstream error;
        error << "error " << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
              << ": " << e.what_without_backtrace();
        outcome = error.str();
      }
    } else if (alone == "1") {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // busy elsewhere, not in a forward
    }
    if (alone == "2") {
      group->barrier()->wait();
      train_one_step();  // the ranks go on
    }
    const at::Tensor masters = masters_of(model, scratch, *group);  // every rank: the gather completes
    if (alone == "2") trace.push_back(masters);
    if (rank == 0) {
      if (read.defined() && alone == "2") {
        outcome = "ran";  // the masters have moved on since
      } else if (read.defined()) {  // the weights forward read: the step's masters, rounded
        std::vector<at::Tensor> rounded;
        int64_t offset = 0;
        for (const auto& p : model->parameters()) {
          rounded.push_back(masters.narrow(0, offset, p.numel()).to(p.scalar_type()).to(at::kFloat));
          offset += p.numel();
        }
        outcome = torch::equal(read, torch::cat(rounded)) ? "same" : "stale";
      }
      std::ofstream(out_path + ".alone") << outcome;
    }
  }
  trace.push_back(torch::tensor(amp::skipped_steps(*optimizer)));
  trace.push_back(torch::tensor(amp::loss_scaler()->scale()));
  torch::save(trace, out_path);
  // Before main returns (data_parallel.h): the process group then goes with
  // main's locals, its worker threads ending while CUDA is loaded.
  amp::deinitialize();
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: dist_helper <rank> <world_size> <store_file> <output_file> [key=value ...]\n";
    return 2;
  }
  const int rank = std::stoi(argv[1]), world = std::stoi(argv[2]);
  std::map<std::string, std::string> flags{{"level", "O2"}, {"reduce", "builtin"}, {"optimizer", "sgd"},
                                           {"micro_batches", "1"}, {"reduce_dtype", "float"},
                                           {"bucket_bytes", "64"}, {"seed_per_rank", "0"},
                                           {"shard", "0"}, {"clip", "0"}, {"checkpoint", ""},
                                           {"save_after", "-1"}, {"resume", "0"}, {"device", "cpu"},
                                           {"shard_gradients", "1"}, {"shard_weights", "0"}, {"recompute", "0"},
                                           {"alone_forward", "0"}, {"gather_timeout_ms", "60000"},
                                           {"lone", "1"}, {"group_timeout_ms", "1800000"},
                                           {"fp8", "0"}, {"positions", "none"}, {"state8", "0"}, {"hidden", "16"},
                                           {"evaluate", "0"}, {"backend", "gloo"}, {"phases", "1"},
                                           {"optimizers", ""}, {"static_scale", "0"}, {"step_in_backward", "0"}};
  for (int i = 5; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (eq == std::string::npos || !flags.count(arg.substr(0, eq))) {
      std::cerr << "unknown argument " << arg << "\n";
      return 2;
    }
    flags[arg.substr(0, eq)] = arg.substr(eq + 1);
  }
  // phases=N: N runs one after another in this process, each with a new
  // process group over a store of its own and the next optimizer of
  // `optimizers` (a comma-separated list; `optimizer` when empty); phase k
  // writes <output_file>.phase<k>.
  const int phases = std::stoi(flags["phases"]);
  std::vector<std::string> optimizers;
  std::stringstream list(flags["optimizers"].empty() ? flags["optimizer"] : flags["optimizers"]);
  for (std::string name; std::getline(list, name, ',');) optimizers.push_back(name);
  for (int phase = 0; phase < phases; ++phase) {
    auto phase_flags = flags;
    phase_flags["optimizer"] = optimizers[phase % optimizers.size()];
    const std::string suffix = phases > 1 ? ".phase" + std::to_string(phase) : "";
    if (const int rc = run(rank, world, argv[3] + suffix, argv[4] + suffix, phase_flags); rc != 0) return rc;
  }
  return 0;
}
