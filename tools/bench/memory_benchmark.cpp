// SPDX-License-Identifier: BSD-3-Clause
// Memory benchmark: how large a model amp lets a program train.
//
// A GPT-shaped decoder (examples/common/char_transformer.h: byte tokens,
// learned positions, pre-norm blocks of causal 4-head attention and a 4x
// GELU MLP, tied head; width 256, context 256, batch 8 by default) takes AdamW steps on
// Debian's license texts under each configuration: plain LibTorch float32;
// amp O1, O2, O5; O5 with every block recomputed (amp::recompute), and
// selectively (its GEMMs' outputs kept, amp::Keep::gemm_outputs); O6 (bf16
// without masters, stochastic rounding) with recomputation; both with 8-bit
// optimizer state (optimizer_state_dtype uint8), and with the step in
// backward (step_in_backward), that also with recomputation in two levels
// (runs of about sqrt(depth) blocks recomputed around their recomputed
// blocks: fewer kept block inputs for a third forward), or each block in
// slices of the batch (amp::recompute_in_slices: a slice's activations at
// once); the O2, O5 and recomputed ones sharded at
// world sizes 2 and 4 (ZeRO-2 over Gloo, and the recomputed ones with
// their weights sharded too: ZeRO-3; O6 + 8-bit state with the step in
// backward sharded both ways, each rank stepping its pieces as their
// buckets are reduced; ranks
// started by this program, bytes per rank), each beside the same
// configuration replicated (plain data parallel) at the same per-rank
// batch, which separates sharding's saving from the smaller batch's; and
// Python's torch on the same model
// (memory_peer.py): float32, autocast, autocast + torch.utils.checkpoint
// (whole blocks, or keeping the GEMMs' outputs: selective activation
// checkpointing), and that with torchao's AdamW8bit.
// --width, --heads, --context and --batch set the decoder's shape (768, 12,
// 1024: GPT-2-small's); --attention=math computes attention as its ops,
// which keep each head's scores and softmax for backward (what selective
// recomputation was designed to drop), instead of the fused kernel.
// --vocab (byte pairs folded into that many ids; 50304: GPT-2's) and
// --width set the output layer (--loss_layer: that layer alone, unfused against
// fused, and with --python Python's ways: loss_layer_peer.py): "+ fused loss"
// rows compute it and the loss with amp::linear_cross_entropy, and the Python
// peer adds a row that upcasts one chunk of logits at a time (torchtune's
// CEWithChunkedOutputLoss).
//
// Table 1: one step at equal batch and depth: the allocator's peak bytes
// (amp::allocated_bytes: everything the step's tensors held at once,
// parameters and optimizer state included), the part of it above what the
// step started with (activations and gradients), and time per step, as
// ratios to LibTorch float32 measured in the same run. Both tables print
// the peak per parameter beside the configuration's arithmetic floor: the
// bytes a parameter's weight copies, gradient and optimizer state take at
// once (per rank), before any activation.
// Table 2: the largest depth whose step fits --budget_mib, found from the
// peaks at two depths (they grow linearly with depth) and checked by a step
// at the depth found, then trained --train_steps steps: parameters, ratio to
// LibTorch float32's, and the mean loss of the last five steps.
//
//   memory_benchmark --layers=4 --budget_mib=512 --train_steps=20
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>
#include <amp/linear_cross_entropy.h>

#include "bench_util.h"
#include "loss_layer_peer.h"
#include "common/char_transformer.h"
#include "common/run_setup.h"

#include <absl/flags/flag.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include <regex>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <algorithm>
#include <optional>
#include <sstream>
#include <thread>

extern char** environ;

ABSL_FLAG(int, layers, 4, "depth of the equal-batch table");
ABSL_FLAG(int, vocab, 256, "output classes: 256 byte tokens, or more (50304: GPT-2's) from byte pairs");
ABSL_FLAG(int, width, 256, "model width (768: GPT-2-small's)");
ABSL_FLAG(int, heads, 4, "attention heads (12: GPT-2-small's)");
ABSL_FLAG(int, context, 256, "tokens per sequence (1024: GPT-2-small's)");
ABSL_FLAG(int, batch, 8, "sequences per step (the \"in slices\" rows run one at a time)");
ABSL_FLAG(std::string, attention, "fused",
          "fused (scaled_dot_product_attention: no sequence x sequence tensor kept for backward) or math (its ops: "
          "the scores and their softmax kept per head, as attention without a fused kernel keeps them)");
ABSL_FLAG(bool, loss_layer, false, "only the output layer and its loss, bfloat16, batch x context tokens: the "
          "allocator's peak above its inputs, unfused against amp::linear_cross_entropy");
ABSL_FLAG(int, loss_vocab_window, 4096, "the \"fused loss in windows\" rows and --loss_layer's third: the classes "
          "of a window of the vocabulary (amp::linear_cross_entropy's chunk_vocabulary)");
ABSL_FLAG(int, loss_window_chunk_tokens, 512, "the same rows: the tokens of a chunk (chunk_tokens; 0 picks: float32 "
          "logits of at most 32 MiB)");
ABSL_FLAG(double, budget_mib, 512, "allocator budget of the largest-model table, MiB (0: skip that table)");
ABSL_FLAG(int, train_steps, 20, "steps each largest model trains for its loss (0: none)");
ABSL_FLAG(int, timed_steps, 3, "steps timed per configuration (median)");
ABSL_FLAG(std::string, only, "", "run only the configurations whose name a match of this regular expression contains");
ABSL_FLAG(std::string, python, "", "Python with torch for the peer rows (empty: no peer rows)");
ABSL_FLAG(std::string, peer_script, "", "memory_peer.py (default: beside this program's source)");
ABSL_FLAG(std::vector<std::string>, budget_depths, {},
          "largest-model table: amp's rows try only these depths (comma-separated) and show the deepest that "
          "fits, a lower bound on their largest, and each that does not, an upper bound (LibTorch float32 is "
          "still searched); empty: every row searched");
ABSL_FLAG(double, bucket_mib, 4,
          "data-parallel rows: data_parallel.bucket_bytes in MiB (DDP's 25 holds up to three such buckets "
          "of float32 gradients at once)");
// Set by the launcher for the ranks it starts.
ABSL_FLAG(bool, phases, false, "print the measured step's allocator bytes (now, and the peak since the last phase) "
          "after forward, backward, the guard and the step (rank 0), to stderr");
ABSL_FLAG(int, rank, -1, "internal: this process is one rank of a data-parallel configuration");
ABSL_FLAG(int, world, 1, "internal: ranks of that configuration");
ABSL_FLAG(std::string, store, "", "internal: rendezvous file of the ranks");
ABSL_FLAG(std::string, config, "", "internal: the configuration a rank runs");
ABSL_FLAG(int, run_layers, 0, "internal: the depth a rank runs");
ABSL_FLAG(std::string, result, "", "internal: where a rank writes its figures");

namespace {

int64_t context() { return absl::GetFlag(FLAGS_context); }
int64_t batch() { return absl::GetFlag(FLAGS_batch); }
int slices() { return static_cast<int>(batch()); }  // "in slices": one sequence of the batch at a time

struct Config {
  std::string name;
  std::optional<amp::OptLevel> level;  // none: LibTorch without amp
  bool recompute = false;
  int world = 1;
  bool shard = false;  // with world > 1: ZeRO-2 (otherwise replicated)
  bool state8 = false;  // optimizer_state_dtype uint8 (amp's FusedAdamW)
  bool in_backward = false;  // step_in_backward (amp's FusedAdamW)
  bool shard_weights = false;  // with shard: ZeRO-3
  bool two_levels = false;  // with recompute: runs of about sqrt(depth) blocks recomputed around the blocks
  int slices = 0;  // with recompute, > 1: each block run in this many slices of the batch (recompute_in_slices)
  bool fused_loss = false;  // the head and loss through amp::linear_cross_entropy
  bool loss_windows = false;  // with fused_loss: the vocabulary in windows (--loss_vocab_window)
  bool keep_gemms = false;  // with recompute: each block keeps its GEMMs' outputs (amp::Keep::gemm_outputs)
  bool fused_adam = false;  // amp's FusedAdamW where LibTorch's AdamW would step
};

// The configuration of `configs` called `name`.
const Config& named(const std::vector<Config>& configs, const std::string& name) {
  return *std::find_if(configs.begin(), configs.end(), [&](const Config& c) { return c.name == name; });
}

// `config` recomputing selectively: its blocks keep their GEMMs' outputs.
Config selective(Config config) {
  config.name.replace(config.name.find("recompute"), 9, "selective recompute");
  config.keep_gemms = true;
  return config;
}

// `config` with its loss through amp::linear_cross_entropy (`windows`: the
// vocabulary in windows, whose weight gradient's float32 sum is a window's).
Config fused(Config config, bool windows = false) {
  config.name += windows ? " + fused loss in windows" : " + fused loss";
  config.fused_loss = true;
  config.loss_windows = windows;
  return config;
}

std::vector<Config> configs() {
  std::vector<Config> out = {{"LibTorch fp32", std::nullopt}, {"amp O1", amp::O1},
                             {"amp O2", amp::O2},             {"amp O5", amp::O5},
                             {"amp O5 + recompute", amp::O5, true}, {"amp O6 + recompute", amp::O6, true},
                             {"amp O5 + recompute + 8-bit state", amp::O5, true, 1, false, true},
                             {"amp O6 + recompute + 8-bit state", amp::O6, true, 1, false, true},
                             {"amp O6 + recompute + step in backward", amp::O6, true, 1, false, false, true},
                             {"amp O6 + recompute + 8-bit state + step in backward", amp::O6, true, 1, false, true, true},
                             {"amp O6 + recompute in two levels + 8-bit state + step in backward", amp::O6, true, 1,
                              false, true, true, false, true},
                             {"amp O5 + recompute in slices + 8-bit state", amp::O5, true, 1, false, true, false, false,
                              false, slices()},
                             {"amp O6 + recompute in slices + 8-bit state + step in backward", amp::O6, true, 1, false,
                              true, true, false, false, slices()}};
  Config fused_adam{"amp O5 + recompute + fused AdamW", amp::O5, true};
  fused_adam.fused_adam = true;  // no step transient of LibTorch's AdamW (a tensor-sized temporary or two)
  out.push_back(fused_adam);
  for (const std::string name : {"amp O5 + recompute", "amp O6 + recompute"}) {
    out.push_back(selective(named(out, name)));
  }
  for (const std::string name : {"amp O1", "amp O5 + recompute", "amp O5 + recompute + fused AdamW",
                                 "amp O6 + recompute", "amp O6 + recompute + 8-bit state + step in backward"}) {
    out.push_back(fused(named(out, name)));
  }
  for (const std::string name : {"amp O5 + recompute + fused AdamW", "amp O6 + recompute",
                                 "amp O6 + recompute + 8-bit state + step in backward"}) {
    out.push_back(fused(named(out, name), true));
  }
  for (int world : {2, 4}) {
    for (bool shard : {false, true}) {
      const std::string per = (shard ? " sharded x" : " replicated x") + std::to_string(world);
      out.push_back({"amp O2" + per, amp::O2, false, world, shard});
      out.push_back({"amp O5" + per, amp::O5, false, world, shard});
      out.push_back({"amp O5 + recompute" + per, amp::O5, true, world, shard});
      out.push_back({"amp O6 + recompute" + per, amp::O6, true, world, shard});
      out.push_back({"amp O6 + recompute + 8-bit state" + per, amp::O6, true, world, shard, true});
      out.push_back({"amp O6 + recompute in slices and two levels + 8-bit state" + per, amp::O6, true, world, shard,
                     true, false, false, true, slices()});
    }
    const std::string zero3 = " ZeRO-3 x" + std::to_string(world);
    out.push_back({"amp O5 + recompute" + zero3, amp::O5, true, world, true, false, false, true});
    out.push_back({"amp O6 + recompute" + zero3, amp::O6, true, world, true, false, false, true});
    out.push_back({"amp O6 + recompute + 8-bit state" + zero3, amp::O6, true, world, true, true, false, true});
    out.push_back({"amp O6 + recompute in slices and two levels + 8-bit state" + zero3, amp::O6, true, world, true,
                   true, false, true, true, slices()});
    // Each rank steps its pieces as their buckets are reduced.
    const std::string in_backward = "amp O6 + recompute + 8-bit state + step in backward";
    out.push_back({in_backward + " sharded x" + std::to_string(world), amp::O6, true, world, true, true, true});
    out.push_back({in_backward + zero3, amp::O6, true, world, true, true, true, true});
    out.push_back({"amp O6 + recompute in two levels + 8-bit state + step in backward" + zero3, amp::O6, true, world,
                   true, true, true, true, true});
  }
  return out;
}

struct Figures {
  double peak_mib = 0, ms_per_step = 0, loss = NAN;
  double above_start_mib = 0;  // the peak above what the step started with (activations, gradients)
  int64_t parameters = 0;
};

// Training steps of one configuration in this process (one rank of it
// when `group` is set): a warm-up step creates the optimizer state, the
// next is measured, then --timed_steps are timed and `train_steps` more
// give the loss.
class Trainer {
 public:
  Trainer(const Config& config, int layers, c10::intrusive_ptr<c10d::ProcessGroupGloo> group)
      : config_(config), group_(std::move(group)), corpus_(corpus()) {
    examples::TransformerConfig shape;
    shape.context = context();
    shape.width = absl::GetFlag(FLAGS_width);
    shape.heads = absl::GetFlag(FLAGS_heads);
    shape.fused_attention = examples::fused_attention_named(absl::GetFlag(FLAGS_attention));
    shape.vocab = absl::GetFlag(FLAGS_vocab);
    shape.fused_loss = config.fused_loss;
    if (config.loss_windows) {
      shape.loss_vocab_window = absl::GetFlag(FLAGS_loss_vocab_window);
      shape.loss_chunk_tokens = absl::GetFlag(FLAGS_loss_window_chunk_tokens);
    }
    shape.layers = layers;
    shape.tied_head = true;
    shape.recompute = config.recompute;
    shape.recompute_slices = config.slices;
    shape.recompute_keep_gemms = config.keep_gemms;
    if (config.two_levels) shape.recompute_run = std::lround(std::sqrt(double(layers)));
    torch::manual_seed(0);
    model_ = examples::CharTransformer(shape);
    if (config.level == amp::O6 || config.state8 || config.in_backward || config.fused_adam) {
      optimizer_ = std::make_shared<amp::optim::FusedAdamW>(model_->parameters(), torch::optim::AdamWOptions(1e-3));
    } else {
      optimizer_ = std::make_shared<torch::optim::AdamW>(model_->parameters(), torch::optim::AdamWOptions(1e-3));
    }
    if (config.level) {
      amp::Options options = *config.level;
      options.verbosity = 0;
      if (config.state8) options.optimizer_state_dtype = at::kByte;
      options.step_in_backward = config.in_backward;
      if (group_) {
        options.data_parallel.group = group_;
        options.data_parallel.shard = config_.shard;
        options.data_parallel.shard_weights = config_.shard_weights;
        options.data_parallel.bucket_bytes = static_cast<int64_t>(absl::GetFlag(FLAGS_bucket_mib) * 1048576);
      }
      handle_.initialize(model_, *optimizer_, options);
    }
  }

  Figures run(int timed, int train_steps) {
    Figures f;
    for (const auto& p : model_->parameters()) f.parameters += p.numel();
    step(0);
    optimizer_->zero_grad();
    amp::reset_peak_allocated();
    const int64_t start = amp::allocated_bytes().current;
    step(1);
    const int64_t peak = std::max(amp::allocated_bytes().peak, phase_peak_);
    f.above_start_mib = (peak - start) / 1048576.0;
    // The corpus is the program's, not the step's (the Python peer counts tensors of the step alone).
    f.peak_mib = (peak - corpus_.nbytes()) / 1048576.0;
    std::vector<double> ms;
    for (int i = 0; i < timed; ++i) {
      const auto start = std::chrono::steady_clock::now();
      step(2 + i);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    f.ms_per_step = bench::median(ms);
    std::vector<double> losses;
    for (int i = 0; i < train_steps; ++i) losses.push_back(step(10 + i));
    if (!losses.empty()) {
      const size_t last = std::min<size_t>(5, losses.size());
      f.loss = std::accumulate(losses.end() - last, losses.end(), 0.0) / last;
    }
    return f;
  }

 private:
  static const at::Tensor& corpus() {
    static const at::Tensor bytes = [] {
      const std::string text = examples::read_license_corpus();
      const int64_t vocab = absl::GetFlag(FLAGS_vocab);
      if (vocab != 256) return examples::corpus_tokens(text, vocab);
      auto t = torch::empty({int64_t(text.size())}, torch::kByte);
      std::memcpy(t.data_ptr(), text.data(), text.size());
      return t;
    }();
    return bytes;
  }

  // One step on batch `number` (this rank's rows of it in data parallel).
  double step(int number) {
    torch::manual_seed(1000 + number);
    const auto starts = torch::randint(0, corpus_.size(0) - context() - 1, {batch()});
    at::Tensor windows = corpus_.index({starts.unsqueeze(1) + torch::arange(context() + 1)}).to(torch::kLong);
    if (group_) windows = windows.chunk(config_.world)[group_->getRank()];
    const at::Tensor inputs = windows.narrow(1, 0, context()), targets = windows.narrow(1, 1, context());
    optimizer_->zero_grad();
    // --phases: the measured step's allocator bytes after each phase (rank 0).
    const bool phases = absl::GetFlag(FLAGS_phases) && number == 1 && (!group_ || group_->getRank() == 0);
    auto phase = [&](const char* name) {
      if (!phases) return;
      const auto b = amp::allocated_bytes();
      std::fprintf(stderr, "%-10s current %.1f MiB peak %.1f MiB\n", name, b.current / 1048576.0, b.peak / 1048576.0);
      phase_peak_ = std::max(phase_peak_, b.peak);  // the step's peak, across the resets
      amp::reset_peak_allocated();
    };
    phase("start");
    const at::Tensor loss = model_->loss(inputs, targets);
    phase("forward");
    if (config_.level) {
      amp::scale_loss scaled(loss, *optimizer_);
      scaled.backward();
      phase("backward");
    } else {
      loss.backward();
    }
    phase("guard end");
    optimizer_->step();
    phase("step");
    return loss.item<double>();
  }

  Config config_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  const at::Tensor& corpus_;
  examples::CharTransformer model_{nullptr};
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  amp::Handle handle_;
  int64_t phase_peak_ = 0;  // --phases: the highest peak a phase saw
};

std::string serialize(const Figures& f) {
  std::ostringstream out;
  out << f.peak_mib << " " << f.ms_per_step << " " << f.loss << " " << f.parameters << " " << f.above_start_mib;
  return out.str();
}

Figures deserialize(const std::string& text) {
  Figures f;
  std::istringstream in(text);
  std::string loss;
  in >> f.peak_mib >> f.ms_per_step >> loss >> f.parameters >> f.above_start_mib;
  f.loss = loss == "nan" ? NAN : std::stod(loss);
  return f;
}

// A data-parallel configuration: its ranks as processes of this program; the
// largest rank's peak, rank 0's time and loss.
Figures run_ranks(const Config& config, int layers, int timed, int train_steps) {
  if (batch() % config.world != 0) {
    throw std::invalid_argument("\"" + config.name + "\" splits the batch over its ranks: --batch must be a multiple " +
                                "of " + std::to_string(config.world) + " (or leave it out with --only)");
  }
  const std::string base = "/tmp/amp_memory_" + std::to_string(getpid()) + "_" + std::to_string(std::rand());
  std::vector<pid_t> pids;
  for (int rank = 0; rank < config.world; ++rank) {
    std::vector<std::string> args = {"/proc/self/exe", "--rank=" + std::to_string(rank),
                                     "--world=" + std::to_string(config.world), "--store=" + base + ".store",
                                     "--config=" + config.name, "--run_layers=" + std::to_string(layers),
                                     "--train_steps=" + std::to_string(train_steps),
                                     "--timed_steps=" + std::to_string(timed),
                                     "--vocab=" + std::to_string(absl::GetFlag(FLAGS_vocab)),
                                     "--width=" + std::to_string(absl::GetFlag(FLAGS_width)),
                                     "--heads=" + std::to_string(absl::GetFlag(FLAGS_heads)),
                                     "--context=" + std::to_string(context()), "--batch=" + std::to_string(batch()),
                                     "--attention=" + absl::GetFlag(FLAGS_attention),
                                     "--bucket_mib=" + std::to_string(absl::GetFlag(FLAGS_bucket_mib)),
                                     std::string("--phases=") + (absl::GetFlag(FLAGS_phases) ? "true" : "false"),
                                     "--result=" + base + "." + std::to_string(rank)};
    std::vector<char*> raw;
    for (auto& a : args) raw.push_back(a.data());
    raw.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, raw.data(), environ) != 0) {
      throw std::runtime_error("cannot start a rank");
    }
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) throw std::runtime_error("a rank of " + config.name + " failed");
  }
  Figures out;
  for (int rank = 0; rank < config.world; ++rank) {
    std::ifstream in(base + "." + std::to_string(rank));
    std::string line;
    std::getline(in, line);
    const Figures f = deserialize(line);
    if (rank == 0) out = f;
    out.peak_mib = std::max(out.peak_mib, f.peak_mib);
    out.above_start_mib = std::max(out.above_start_mib, f.above_start_mib);
    std::remove((base + "." + std::to_string(rank)).c_str());
  }
  std::remove((base + ".store").c_str());
  return out;
}

Figures measure(const Config& config, int layers, int timed, int train_steps) {
  if (config.world > 1) return run_ranks(config, layers, timed, train_steps);
  return Trainer(config, layers, nullptr).run(timed, train_steps);
}

// One rank of a data-parallel configuration (started by run_ranks).
int rank_main() {
  const int rank = absl::GetFlag(FLAGS_rank), world = absl::GetFlag(FLAGS_world);
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world));
  auto store = c10::make_intrusive<c10d::FileStore>(absl::GetFlag(FLAGS_store), world);
  auto gloo = c10d::ProcessGroupGloo::Options::create();
  gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gloo);
  for (const Config& c : configs()) {
    if (c.name != absl::GetFlag(FLAGS_config)) continue;
    const Figures f = Trainer(c, absl::GetFlag(FLAGS_run_layers), group)
                          .run(absl::GetFlag(FLAGS_timed_steps), absl::GetFlag(FLAGS_train_steps));
    std::ofstream(absl::GetFlag(FLAGS_result)) << serialize(f) << "\n";
    return 0;
  }
  throw std::invalid_argument("unknown configuration " + absl::GetFlag(FLAGS_config));
}

// The Python peer's figures for `mode` at `layers`.
Figures peer(const std::string& mode, int layers, int timed, int train_steps, const std::string& loss_kind = "plain") {
  const std::string python = absl::GetFlag(FLAGS_python);
  std::string script = absl::GetFlag(FLAGS_peer_script);
  if (script.empty()) script = std::string(AMP_SOURCE_DIR) + "/tools/bench/memory_peer.py";
  const std::string command = python + " " + script + " --mode=" + mode + " --loss=" + loss_kind + " --layers=" + std::to_string(layers) +
                              " --vocab=" + std::to_string(absl::GetFlag(FLAGS_vocab)) +
                              " --width=" + std::to_string(absl::GetFlag(FLAGS_width)) +
                              " --heads=" + std::to_string(absl::GetFlag(FLAGS_heads)) +
                              " --context=" + std::to_string(context()) + " --batch=" + std::to_string(batch()) +
                              " --attention=" + absl::GetFlag(FLAGS_attention) +
                              " --train_steps=" + std::to_string(train_steps) +
                              " --timed_steps=" + std::to_string(timed) + " 2>/dev/null";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("cannot run " + command);
  char buffer[512];
  std::string line;
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) line = buffer;
  if (pclose(pipe) != 0) throw std::runtime_error("the Python peer failed: " + command);
  std::istringstream in(line);
  std::string word, loss;
  Figures f;
  int ignored;
  in >> word >> word >> word >> ignored >> word >> f.parameters >> word >> f.peak_mib >> word >> f.above_start_mib >> word >>
      f.ms_per_step >> word >> loss;
  f.loss = loss == "nan" ? NAN : std::stod(loss);
  return f;
}

struct Row {
  std::string name;
  double floor = 0;  // bytes a parameter's weights, gradient and state take at once (per rank)
  // Measures at a depth, timing `timed` steps and training `train` more.
  std::function<Figures(int layers, int timed, int train)> measure;
};

// The arithmetic floor of `c` (Row::floor), AdamW: float32 weights,
// gradients and two moments take 4 + 4 + 8; O1's cast cache adds the
// bfloat16 copy of the weights forward and backward read; O2/O5 hold their
// copy and bfloat16 gradients (2 + 2) during backward, the float32
// gradients (4) once the copies are freed, so the copy adds nothing; O6
// keeps 2 + 2 + 4; 8-bit state 2 for the moments; the step in backward
// holds no gradient; sharding keeps 1/world of the float32 masters (O6: of
// the weights' pieces), gradients and state, the gathered low-precision
// weights whole; ZeRO-3 gathers them block by block, so 1/world of
// everything.
double floor_bytes(const Config& c) {
  const bool masters = c.level == amp::O2 || c.level == amp::O5;
  const double weights = c.level == amp::O6 ? 2 : 4;
  const double gradients = c.in_backward ? 0 : weights, state = c.state8 ? 2 : c.level == amp::O6 ? 4 : 8;
  if (!c.shard) return weights + (c.level == amp::O1 ? 2 : 0) + gradients + state;
  if (c.shard_weights) return (weights + gradients + state) / c.world;
  const double copy = masters ? 2 : 0;
  return (c.level == amp::O6 ? 2 : copy) + (weights + gradients + state) / c.world;
}

std::vector<Row> rows() {
  std::vector<Row> out;
  const std::regex only(absl::GetFlag(FLAGS_only));
  for (const Config& c : configs()) {
    if (!std::regex_search(c.name, only) && c.name != "LibTorch fp32") continue;
    out.push_back({c.name, floor_bytes(c), [c](int layers, int timed, int train) { return measure(c, layers, timed, train); }});
  }
  if (absl::GetFlag(FLAGS_python).empty()) return out;
  for (const auto& [name, mode] : std::vector<std::pair<std::string, std::string>>{
           {"Python fp32", "fp32"}, {"Python autocast", "autocast"}, {"Python autocast + checkpoint", "checkpoint"},
           {"Python autocast + selective checkpoint (GEMMs kept)", "checkpoint_gemms"},
           {"Python autocast + checkpoint + torchao AdamW8bit", "checkpoint8bit"}}) {
    if (!std::regex_search(name, only)) continue;
    // float32 weights and gradients; autocast without checkpoint keeps the
    // bfloat16 weight copies forward saved until backward.
    const double floor = mode == "checkpoint8bit" ? 4 + 4 + 2 : mode == "autocast" ? 4 + 2 + 4 + 8 : 4 + 4 + 8;
    out.push_back({name, floor, [mode = mode](int layers, int timed, int train) { return peer(mode, layers, timed, train); }});
  }
  // A large vocabulary: the output layer and loss torchtune's way too.
  const std::string chunked = "Python autocast + checkpoint + chunked loss";
  if (absl::GetFlag(FLAGS_vocab) != 256 && std::regex_search(chunked, only)) {
    out.push_back({chunked, 4 + 4 + 8, [](int layers, int timed, int train) {
                     return peer("checkpoint", layers, timed, train, "chunked");
                   }});
  }
  return out;
}

double bytes_per_parameter(const Figures& f) { return f.peak_mib * 1048576.0 / static_cast<double>(f.parameters); }

void equal_batch_table(const std::vector<Row>& table, int layers) {
  std::printf("\n1. One AdamW step, GPT-shaped decoder (width %d, %d heads, %s attention, vocabulary %d, context %lld, "
              "batch %lld, %d blocks), allocator bytes (per rank in data parallel)\n\n",
              absl::GetFlag(FLAGS_width), absl::GetFlag(FLAGS_heads), absl::GetFlag(FLAGS_attention).c_str(),
              absl::GetFlag(FLAGS_vocab), (long long)context(), (long long)batch(), layers);
  std::printf("| configuration | parameters | peak MiB | peak / fp32 | above start MiB | above start / fp32 | ms/step | "
              "time / fp32 | peak bytes / parameter | floor |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::optional<Figures> fp32;
  for (const Row& row : table) {
    const Figures f = row.measure(layers, absl::GetFlag(FLAGS_timed_steps), 0);
    if (!fp32) fp32 = f;
    std::printf("| %s | %lld | %.1f | %.2f | %.1f | %.2f | %.0f | %.2f | %.1f | %.1f |\n", row.name.c_str(),
                (long long)f.parameters, f.peak_mib, f.peak_mib / fp32->peak_mib, f.above_start_mib,
                f.above_start_mib / fp32->above_start_mib, f.ms_per_step, f.ms_per_step / fp32->ms_per_step,
                bytes_per_parameter(f), row.floor);
    std::fflush(stdout);
  }
}

// The deepest model whose step's peak fits the budget: peaks grow about
// linearly with depth, so each guess follows the line through the last two
// measurements, kept between the deepest that fit and the shallowest that
// did not. Given `depths`, it measures only those.
struct Search {
  int fits = 0;  // the deepest that fit (0: none)
  std::map<int, Figures> measured;  // by depth
};
Search largest_in_budget(const Row& row, double budget, const std::vector<int>& depths) {
  std::map<int, Figures> measured;
  auto peak_at = [&](int layers) {
    if (!measured.count(layers)) measured[layers] = row.measure(layers, /*timed=*/0, /*train=*/0);
    return measured[layers].peak_mib;
  };
  if (!depths.empty()) {
    int deepest = 0;
    for (int depth : depths) {
      if (peak_at(depth) <= budget) deepest = std::max(deepest, depth);
    }
    return {deepest, measured};
  }
  int fits = 0, too_deep = 1 << 20, previous = 2, current = 4;
  for (int layers : {previous, current}) (peak_at(layers) <= budget ? fits : too_deep) = layers;
  while (too_deep - fits > 1) {
    const double slope = (peak_at(current) - peak_at(previous)) / (current - previous);
    int guess = current + static_cast<int>(std::floor((budget - peak_at(current)) / std::max(slope, 1e-3)));
    guess = std::clamp(guess, fits + 1, too_deep - 1);
    if (guess == current) guess = peak_at(current) <= budget ? current + 1 : current - 1;
    previous = current, current = guess;
    (peak_at(current) <= budget ? fits : too_deep) = current;
  }
  return {fits, measured};
}

void budget_table(const std::vector<Row>& table, double budget, int train_steps) {
  std::printf("\n2. The largest model whose step fits %.0f MiB of allocator bytes (per rank in data parallel), "
              "trained %d steps\n\n", budget, train_steps);
  std::printf("| configuration | blocks | parameters | parameters / fp32 | peak MiB | peak bytes / parameter | floor | "
              "loss (last 5 steps) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
  std::vector<int> depths;  // --budget_depths, for every row but the float32 reference (the first)
  for (const std::string& depth : absl::GetFlag(FLAGS_budget_depths)) depths.push_back(std::stoi(depth));
  int64_t fp32_parameters = 0;  // 0: float32 fits no depth (the ratios are left out)
  auto print = [&](const Row& row, int blocks, const Figures& f, const std::string& last) {
    char ratio[32] = "-";
    if (fp32_parameters > 0) std::snprintf(ratio, sizeof ratio, "%.2f", double(f.parameters) / fp32_parameters);
    std::printf("| %s | %d | %lld | %s | %.1f | %.1f | %.1f | %s |\n", row.name.c_str(), blocks,
                (long long)f.parameters, ratio, f.peak_mib, bytes_per_parameter(f), row.floor, last.c_str());
    std::fflush(stdout);
  };
  for (const Row& row : table) {
    const bool reference = &row == &table.front();
    const std::vector<int> tried = reference ? std::vector<int>{} : depths;
    const Search search = largest_in_budget(row, budget, tried);
    // A depth tried that did not fit: an upper bound on the largest.
    for (const auto& [blocks, f] : search.measured) {
      if (!tried.empty() && f.peak_mib > budget) print(row, blocks, f, "over the budget");
    }
    if (search.fits == 0) {
      // Said, not skipped: one block already over (a large vocabulary's logits).
      const auto one = search.measured.find(1);
      char peak[32] = "-";
      if (one != search.measured.end()) std::snprintf(peak, sizeof peak, "%.1f", one->second.peak_mib);
      std::printf("| %s | 0 | 0 | - | %s | - | %.1f | does not fit at 1 block |\n", row.name.c_str(), peak, row.floor);
      std::fflush(stdout);
      continue;
    }
    const Figures& fit = search.measured.at(search.fits);
    if (reference) fp32_parameters = fit.parameters;
    // Without training, the search's own step at that depth is the row.
    const double loss = train_steps > 0 ? row.measure(search.fits, /*timed=*/0, train_steps).loss : fit.loss;
    char text[32];
    std::snprintf(text, sizeof text, "%.3f", loss);
    print(row, search.fits, fit, text);
  }
}

// --loss_layer: the output layer and its mean cross-entropy alone, forward
// and backward, its inputs (hidden states, weight) in bfloat16 and held
// before it: the peak above them, and time, median of 3.
int loss_layer_table() {
  const int64_t tokens = batch() * context(), width = absl::GetFlag(FLAGS_width), vocab = absl::GetFlag(FLAGS_vocab);
  std::printf("\n0. The output layer and its loss alone (%lld tokens, width %lld, vocabulary %lld, bfloat16): "
              "peak allocator bytes above its inputs\n\n| loss | peak MiB | / unfused | ms | / unfused |\n"
              "|---|---:|---:|---:|---:|\n", (long long)tokens, (long long)width, (long long)vocab);
  torch::manual_seed(0);
  const at::Tensor h = torch::randn({tokens, width}).to(at::kBFloat16).requires_grad_();
  const at::Tensor w = (torch::randn({vocab, width}) * 0.02).to(at::kBFloat16).requires_grad_();
  const at::Tensor y = torch::randint(0, vocab, {tokens});
  const int64_t window = absl::GetFlag(FLAGS_loss_vocab_window);
  const int64_t window_chunk = absl::GetFlag(FLAGS_loss_window_chunk_tokens) > 0
                                   ? absl::GetFlag(FLAGS_loss_window_chunk_tokens)
                                   : amp::default_loss_chunk_tokens(tokens, window);
  double unfused_mib = 0, unfused_ms = 0;
  for (int way = 0; way < 3; ++way) {  // unfused, fused, fused in windows of the vocabulary
    const bool fused = way > 0;
    std::vector<double> ms;
    double mib = 0;
    for (int i = 0; i < 3; ++i) {
      h.mutable_grad().reset();
      w.mutable_grad().reset();
      amp::reset_peak_allocated();
      const int64_t before = amp::allocated_bytes().current;
      const auto start = std::chrono::steady_clock::now();
      const at::Tensor loss = fused ? (way == 2 ? amp::linear_cross_entropy(h, w, {}, y, {}, window_chunk, window)
                                                        : amp::linear_cross_entropy(h, w, {}, y))
                                    : torch::cross_entropy_loss(at::linear(h, w).to(at::kFloat), y);
      loss.backward();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      mib = (amp::allocated_bytes().peak - before) / 1048576.0;
    }
    if (!fused) unfused_mib = mib, unfused_ms = bench::median(ms);
    const std::string name = !fused ? "linear + cross_entropy"
                             : way == 1 ? "amp::linear_cross_entropy"
                                        : "amp::linear_cross_entropy, vocabulary in windows of " + std::to_string(window) +
                                              " (chunks of " +
                                              std::to_string(window_chunk) + " tokens)";
    std::printf("| %s | %.1f | %.3f | %.0f | %.2f |\n", name.c_str(), mib, mib / unfused_mib, bench::median(ms),
                bench::median(ms) / unfused_ms);
  }
  // Python's ways, on the same shape and inputs' dtypes (the same bytes: the
  // unfused rows count alike).
  if (!absl::GetFlag(FLAGS_python).empty()) {
    bench::print_loss_layer_peers(absl::GetFlag(FLAGS_python), std::string(AMP_SOURCE_DIR) + "/tools/bench/loss_layer_peer.py",
                                  "cpu", tokens, width, vocab, {unfused_mib, unfused_ms, 0, false});
  }
  std::printf("\nAll include the gradients of hidden (%.1f MiB) and weight (%.1f MiB) in bfloat16.\n",
              tokens * width * 2 / 1048576.0, vocab * width * 2 / 1048576.0);
  return 0;
}

int run() {
  examples::fused_attention_named(absl::GetFlag(FLAGS_attention));  // a bad name stops here, not in a row
  if (context() < 2 || batch() < 1 || absl::GetFlag(FLAGS_heads) < 1 ||
      absl::GetFlag(FLAGS_width) % absl::GetFlag(FLAGS_heads) != 0) {
    throw std::invalid_argument("--context must be >= 2, --batch >= 1, --width a multiple of --heads");
  }
  if (absl::GetFlag(FLAGS_rank) >= 0) return rank_main();
  if (absl::GetFlag(FLAGS_loss_layer)) return loss_layer_table();
  const std::vector<Row> table = rows();
  equal_batch_table(table, absl::GetFlag(FLAGS_layers));
  if (absl::GetFlag(FLAGS_budget_mib) > 0) {
    budget_table(table, absl::GetFlag(FLAGS_budget_mib), absl::GetFlag(FLAGS_train_steps));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::run_main(argc, argv, "How large a GPT-shaped model amp trains in a memory budget.", run);
}
