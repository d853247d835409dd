// SPDX-License-Identifier: BSD-3-Clause
// A random training program: the loop a user writes around amp, as data.
//
// generate_program(seed) draws one, reproducibly from its seed: 1-3 small
// models (Linear, Conv1d, Conv2d, BatchNorm, LayerNorm blocks; a model may
// read tokens through an Embedding, read a weight through a view - a
// position table sliced, a tied embedding transposed, a weight narrowed
// into heads - before or after its other ops, and run some of its blocks
// under amp::recompute, possibly nested or in slices of the batch), 1-2 optimizers (SGD with or without
// momentum, Adam, AdamW), and per iteration 1-2 phases. A phase zeroes the
// gradients of the optimizers it steps, runs 1-3 losses - each a chain of
// models, possibly detached part-way (a GAN's discriminator on fake data),
// possibly crossing into models another phase steps - accumulates
// micro-batches, clips or adds a gradient penalty, and steps. On top: inf or
// NaN injected into a loss's gradients, an exception inside a guard, and a
// save/restore of everything mid-run (in this process or a fresh one).
//
// O5 may run with the fp8 property.
//
// Every program is well formed for plain LibTorch in float64 (the oracle):
// each guard lists every optimizer that steps in its phase and owns a model
// its loss reaches, and gradients that leak into a model stepped elsewhere
// are zeroed before they are used.
#pragma once

#include <amp/opt_levels.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace amp::scenarios {

inline constexpr int64_t kWidth = 8;       // every model maps [batch, 8] -> [batch, 8]
inline constexpr int64_t kBatch = 6;
inline constexpr int64_t kVocabulary = 10;  // token models: [batch, kTokens] ints
inline constexpr int64_t kTokens = 3;

enum class Block { kLinear, kConv1d, kConv2d, kBatchNorm, kLayerNorm, kTableView };
// How a kTableView block reads its model's table ([kWidth, kWidth], its
// first parameter), adding
// tanh of the result to its input: the table's first rows sliced to the
// batch (a position table), x @ table^T (the token Embedding's first rows
// when the model reads tokens: a tied embedding transposed), or the table
// narrowed into two heads, x @ head^T each.
enum class TableView { kPositionSlice, kTransposed, kHeads };
enum class OptimizerKind { kSGD, kAdam, kAdamW };
enum class LossKind { kMse, kSoftplusMean, kCrossEntropy };
enum class Zero { kOptimizer, kModel, kNever };
enum class FaultKind { kInfGradient, kNaNGradient, kNaNLoss };

// Blocks [first, last) of a model run under amp::recompute; `nested`: the
// second half of them again inside it; `slices` > 1 (not nested, blocks
// that map rows to rows): in that many slices of the batch
// (amp::recompute_in_slices).
// `keep`: what the recomputed blocks keep for their reruns (amp::Keep):
// nothing, the GEMMs' outputs, or those of GEMMs, tanh and layer norms.
enum class Kept { kNothing, kGemmOutputs, kSeveralOps };
struct RecomputedBlocks {
  size_t first = 0, last = 0;
  bool nested = false;
  int slices = 0;
  Kept keep = Kept::kNothing;
};

struct ModelSpec {
  bool token_input = false;  // an Embedding reads token ids first
  std::vector<Block> blocks;
  bool affine_norms = true;
  std::optional<RecomputedBlocks> recomputed;
  TableView table_view = TableView::kPositionSlice;  // with a kTableView block
};

struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::kSGD;
  std::vector<int> models;  // owned models, in parameter order
  double lr = 0.05;
  double momentum = 0;  // SGD
  bool nesterov = false;
  double weight_decay = 0;
  bool amsgrad = false;  // Adam, AdamW
};

struct LossSpec {
  std::vector<int> chain;   // models applied in turn; chain[0] reads the data
  int detach_after = -1;    // output of chain[i] detached (gradients reach chain[i+1..])
  LossKind kind = LossKind::kMse;
  std::vector<int> guard;   // optimizers its scale_loss guard lists
  int loss_id = 0;
  std::optional<double> clip;  // unscale() then clip_grad_norm_ to this norm
  double penalty = 0;          // weight of a gradient penalty on chain[0]'s parameters
};

struct Phase {
  std::vector<LossSpec> losses;
  std::vector<int> steps;  // optimizers stepped at the end (each steps in one phase)
  int micro_batches = 1;   // > 1: one loss, accumulated with delay_unscale
};

struct Fault {
  int iteration, phase, loss, micro_batch;
  FaultKind kind;
};

// Thrown by the user's code inside the last guard of a phase; the loop
// catches it and skips the rest of that phase (its steps).
struct GuardException {
  int iteration, phase;
  bool after_unscale;
};

struct Program {
  uint64_t seed = 0;
  std::vector<ModelSpec> models;
  std::vector<OptimizerSpec> optimizers;
  std::vector<Phase> phases;  // run in order, every iteration
  int iterations = 4;
  Zero zero = Zero::kOptimizer;
  int num_losses = 1;
  bool float16 = false;  // O1-O3 compute in float16 instead of bfloat16
  bool dynamic_scaling = false;  // forced when faults are injected
  double init_scale = 256;
  int64_t growth_interval = 2;
  double max_scale = 4096;  // keeps float16 gradients far from overflow
  std::vector<Fault> faults;
  std::optional<GuardException> exception;
  std::optional<int> restart_before;  // save everything, rebuild, load, before this iteration
  // At this one level (a process start costs more than a whole program) the
  // restart happens in a fresh process; at the others in this one.
  std::optional<OptLevel> fresh_process_level;
  // amp's fused Adam, AdamW and SGD (fused.h), which skip on the device,
  // or LibTorch's own classes, whose guards read each verdict on the host
  // and discard an overflowed guard's gradients.
  bool fused_step = true;
  // O5 runs with the fp8 property: Linear blocks' GEMMs in float8. Never
  // with a gradient penalty (a float8 backward cannot be differentiated
  // again).
  bool fp8 = false;
  // Properties::step_in_backward at the levels that allow it (a static
  // scale, no masters: O0, O3, O4, O6). A program drawn with it is made to
  // fit: amp's fused optimizers, a static scale without faults, no
  // exception, clipping, penalty or accumulation, gradients zeroed (they
  // are freed, so none carry over), and each optimizer in one guard per
  // phase.
  bool step_in_backward = false;
  // Options::data_parallel over a process group of one rank, with shard
  // (ZeRO-2) or shard_weights too (ZeRO-3), at the levels that shard (O2,
  // O5, O6 with amp's fused optimizers). A program drawn with it is made to
  // fit: no gradient penalty (a backward outside the guard), no faults
  // injected into gradients (backward hands each bucket to its reduction
  // and leaves none on the model), not in backward.
  enum class Sharding { kNone, kZero2, kZero3 };
  Sharding sharding = Sharding::kNone;
};

Program generate_program(uint64_t seed);

// A few lines naming every choice, printed with a failing seed.
std::string describe(const Program& program);

// Models whose parameters a loss's gradients reach.
std::vector<int> reached_models(const LossSpec& loss);

// The optimizer owning `model`.
int owner_of(const Program& program, int model);

}  // namespace amp::scenarios
