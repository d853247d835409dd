// SPDX-License-Identifier: BSD-3-Clause
// Data-parallel training over ProcessGroupGloo on loopback, ranks started as
// processes (dist_helper). Every run trains 5 steps on a global batch of 24
// rows split across the ranks; the last rank alone overflows at step 2.
//
// Built in (Options::data_parallel): at world sizes 1-4 the replicas stay
// bit-identical, every rank skips step 2, and the parameters follow a
// float64 run of the global batch; world size 1 equals one process without
// a group bit for bit; bucket sizes do not change a bit. The loops that
// average gradients themselves (overflow_all_reduce) are checked as before.
// Sharded (data_parallel.shard): at world sizes 1-4, O2 and O5, SGD, Adam
// and AdamW the float32 masters equal the replicated run's bit for bit;
// accumulation and clipping stay within float32 rounding of it; a sharded
// checkpoint resumes at other world sizes bit for bit as unsharded runs. O6
// shards its bfloat16 weights: ranks agree and resume bit for bit.
// In-process checks over a process group of one rank (collectives that leave
// tensors as they are) cover the guard's side: parameters without
// gradients, two backward passes, errors.
#include "test_util.h"
#include <amp/internal/level_rules.h>

#include "profiled.h"
#include "world_of_one.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

namespace amp::testing {
namespace {

struct RankRun {
  std::vector<at::Tensor> steps;  // flattened parameters after each step
  int64_t skipped = 0;
  double scale = 0;
};

// Starts ranks 0..world-1 of dist_helper with `args`; every rank must exit
// 0. With `phases` > 1 (args carry phases=N) each rank trains N times in its
// process: one result a phase.
std::vector<std::vector<RankRun>> run_ranks_phases(int world, const std::string& args, int phases) {
  static int runs = 0;
  const std::string id = std::to_string(::getpid()) + "_" + std::to_string(runs++);
  const std::string dir = ::testing::TempDir(), store = dir + "amp_dist_store_" + id;
  std::remove(store.c_str());
  std::string command = "sh -c 'r=0;";
  for (int rank = world - 1; rank >= 0; --rank) {
    command += std::string(" ") + AMP_DIST_HELPER + " " + std::to_string(rank) + " " + std::to_string(world) +
               " " + store + " " + dir + "amp_dist_out_" + id + "_" + std::to_string(rank) + " " + args +
               (rank > 0 ? " & p" + std::to_string(rank) + "=$!;" : "|| r=1;");
  }
  for (int rank = 1; rank < world; ++rank) command += " wait $p" + std::to_string(rank) + " || r=1;";
  command += " exit $r'";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  std::vector<std::vector<RankRun>> results(phases, std::vector<RankRun>(world));
  for (int phase = 0; phase < phases; ++phase) {
    const std::string suffix = phases > 1 ? ".phase" + std::to_string(phase) : "";
    for (int rank = 0; rank < world; ++rank) {
      const std::string out = dir + "amp_dist_out_" + id + "_" + std::to_string(rank) + suffix;
      std::vector<at::Tensor> trace;
      torch::load(trace, out);
      std::remove(out.c_str());
      EXPECT_GE(trace.size(), 3u);  // the steps run, then the skipped count and the scale
      results[phase][rank].steps.assign(trace.begin(), trace.end() - 2);
      results[phase][rank].skipped = trace[trace.size() - 2].item<int64_t>();
      results[phase][rank].scale = trace.back().item<double>();
    }
    std::remove((store + suffix).c_str());
    std::remove((store + suffix + ".weights").c_str());  // dist_helper's float32 weights file
  }
  return results;
}

std::vector<RankRun> run_ranks(int world, const std::string& args) { return run_ranks_phases(world, args, 1)[0]; }

// Tests whose amp code runs in the dist_helper processes they start (built
// without sanitizers, so the sanitized suites leave them out).
class RanksAsProcesses : public AmpTest {};

// The same 5 steps in float64 on the whole batch: SGD(lr=0.1), step 2
// skipped, from the helper's initial weights.
std::vector<at::Tensor> float64_reference() {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(6, 16), torch::nn::ReLU(), torch::nn::Linear(16, 2));
  model->to(torch::kDouble);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  std::vector<at::Tensor> steps;
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(100 + step);
    const auto x = torch::randn({24, 6}).to(torch::kDouble), y = torch::randn({24, 2}).to(torch::kDouble);
    sgd.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    if (step != 2) sgd.step();
    std::vector<at::Tensor> parts;
    for (const auto& p : model->parameters()) parts.push_back(p.detach().flatten());
    steps.push_back(torch::cat(parts));
  }
  return steps;
}

// Every rank holds the same bits, skipped step 2 alone (its parameters did
// not move), halved the scale once, and stayed within `bound` of float64.
void expect_trained_together(const std::vector<RankRun>& ranks, double bound) {
  const std::vector<at::Tensor> reference = float64_reference();
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (int step = 0; step < 5; ++step) {
      EXPECT_TRUE(BitEqual(ranks[r].steps[step], ranks[0].steps[step])) << "rank " << r << " step " << step;
    }
    EXPECT_EQ(ranks[r].skipped, 1) << "rank " << r;
    EXPECT_EQ(ranks[r].scale, 32768.0) << "rank " << r;
  }
  EXPECT_TRUE(BitEqual(ranks[0].steps[2], ranks[0].steps[1]));
  for (int step = 0; step < 5; ++step) {
    const double error = (ranks[0].steps[step].to(torch::kDouble) - reference[step]).abs().max().item<double>();
    EXPECT_LE(error, bound) << "step " << step;
  }
}

// The largest distance from float64 a loop of one process reaches: the
// bound data-parallel runs are held to (their reduction adds float32
// rounding, far below the low-precision forward's).
// Measured once per level.
double one_process_error(const std::string& level) {
  static std::map<std::string, double> measured;
  if (auto it = measured.find(level); it != measured.end()) return it->second;
  const RankRun single = run_ranks(1, "level=" + level + " reduce=none")[0];
  const std::vector<at::Tensor> reference = float64_reference();
  double error = 0;
  for (int step = 0; step < 5; ++step) {
    error = std::max(error, (single.steps[step].to(torch::kDouble) - reference[step]).abs().max().item<double>());
  }
  return measured[level] = error;
}

class BuiltInDataParallel : public AmpTest, public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

TEST_P(BuiltInDataParallel, RanksStayIdenticalSkipTogetherAndFollowFloat64) {
  const auto& [level, world] = GetParam();
  // Three times one process's own distance: averaging across ranks
  // reorders float32 sums and splits the low-precision matmuls, no more.
  const double bound = 3 * one_process_error(level);
  ASSERT_GT(bound, 0);
  ASSERT_LT(bound, 2e-2);  // far below what training on one rank's rows alone moves (checked below)
  expect_trained_together(run_ranks(world, "level=" + level), bound);
}

INSTANTIATE_TEST_SUITE_P(LevelsAndWorldSizes, BuiltInDataParallel,
                         ::testing::Values(std::make_tuple("O2", 1), std::make_tuple("O2", 2),
                                           std::make_tuple("O2", 3), std::make_tuple("O2", 4),
                                           std::make_tuple("O1", 2), std::make_tuple("O5", 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world_size_" + std::to_string(std::get<1>(info.param));
                         });

TEST_F(RanksAsProcesses, DataParallelWorldSizeOneIsOneProcessBitForBit) {
  for (const std::string level : {"O1", "O2"}) {
    const auto single = run_ranks(1, "level=" + level + " optimizer=adam reduce=none")[0];
    const auto parallel = run_ranks(1, "level=" + level + " optimizer=adam")[0];
    for (int step = 0; step < 5; ++step) {
      EXPECT_TRUE(BitEqual(parallel.steps[step], single.steps[step])) << level << " step " << step;
    }
    EXPECT_EQ(parallel.skipped, single.skipped);
  }
}

TEST_F(RanksAsProcesses, DataParallelBucketSizeChangesNoBit) {
  const auto one_bucket = run_ranks(3, "bucket_bytes=1000000"), per_parameter = run_ranks(3, "bucket_bytes=1");
  for (int step = 0; step < 5; ++step) {
    EXPECT_TRUE(BitEqual(one_bucket[0].steps[step], per_parameter[0].steps[step])) << "step " << step;
  }
}

TEST_F(RanksAsProcesses, DataParallelAccumulationAveragesTheWholeSum) {
  // Two micro-batches per rank, the first with delay_unscale (no reduction).
  expect_trained_together(run_ranks(3, "micro_batches=2"), 3 * one_process_error("O2"));
}

TEST_F(RanksAsProcesses, DataParallelReducesInLowPrecision) {
  // O2 computes in bfloat16 on the CPU; bfloat16 traffic adds one rounding
  // of each rank's mean gradient and of their sum (2^-8 relative each).
  expect_trained_together(run_ranks(4, "reduce_dtype=bfloat16"), 3 * one_process_error("O2") + 2e-3);
  // Sharded, the float32 pieces take their averages in float32.
  const auto sharded = run_ranks(4, "reduce_dtype=bfloat16 shard=1");
  expect_trained_together(sharded, 3 * one_process_error("O2") + 2e-3);
  for (size_t r = 1; r < sharded.size(); ++r) EXPECT_TRUE(BitEqual(sharded[r].steps.back(), sharded[0].steps.back())) << r;
}

TEST_F(RanksAsProcesses, DataParallelStartsFromRankZerosWeights) {
  // Rank 1 builds its model from another seed; initialize replaces it.
  const auto differently_seeded = run_ranks(2, "seed_per_rank=1");
  const auto ranks = run_ranks(2, "seed_per_rank=0");
  for (int step = 0; step < 5; ++step) {
    EXPECT_TRUE(BitEqual(differently_seeded[1].steps[step], ranks[1].steps[step])) << "step " << step;
  }
}

TEST_F(RanksAsProcesses, WithoutAveragingRanksWouldDrift) {
  // The bounds above mean something: each rank stepping on its own rows
  // alone ends farther from float64 than any of them allows.
  const auto ranks = run_ranks(2, "reduce=local");
  const std::vector<at::Tensor> reference = float64_reference();
  EXPECT_GT((ranks[0].steps[4].to(torch::kDouble) - reference[4]).abs().max().item<double>(), 2e-2);
}

// (opt level, where the loop averages gradients: "inside" or "after" the guard)
class HandWrittenAllReduce : public AmpTest,
                             public ::testing::WithParamInterface<std::tuple<OptLevel, const char*>> {};

TEST_P(HandWrittenAllReduce, EveryRankSkipsTogetherAndReplicasStayIdentical) {
  const std::string level = to_string(std::get<0>(GetParam()));
  const std::string where = std::get<1>(GetParam());
  expect_trained_together(run_ranks(2, "level=" + level + " reduce=" + where), 3 * one_process_error(level));
}

INSTANTIATE_TEST_SUITE_P(LevelsAndPlacements, HandWrittenAllReduce,
                         ::testing::Combine(::testing::Values(O1, O2), ::testing::Values("inside", "after")),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) + "_grads_reduced_" +
                                  std::get<1>(info.param) + "_guard";
                         });

// ---- Sharded (data_parallel.shard): masters, state and gradients 1/N ----------

// Every step of `a` and `b` holds the same bits.
void expect_same_bits(const std::vector<RankRun>& a, const std::vector<RankRun>& b, const std::string& what) {
  ASSERT_EQ(a[0].steps.size(), b[0].steps.size()) << what;
  for (size_t step = 0; step < a[0].steps.size(); ++step) {
    EXPECT_TRUE(BitEqual(a[0].steps[step], b[0].steps[step])) << what << " step " << step;
  }
  EXPECT_EQ(a[0].skipped, b[0].skipped) << what;
  EXPECT_EQ(a[0].scale, b[0].scale) << what;
}

double max_distance(const std::vector<RankRun>& a, const std::vector<RankRun>& b) {
  double distance = 0;
  for (size_t step = 0; step < a[0].steps.size(); ++step) {
    distance = std::max(distance, (a[0].steps[step].to(torch::kDouble) - b[0].steps[step].to(torch::kDouble))
                                      .abs().max().item<double>());
  }
  return distance;
}

// A process that starts over starts clean: sharded runs one after another in
// each rank's process - each with a new process group over a store of its
// own, deinitialized at its end, with the next of the optimizers shard takes
// - train as fresh processes do, bit for bit (ZeRO-2 with every optimizer;
// ZeRO-3 with LibTorch's Adam, whose next forward gathers the weights, and
// amp's fused AdamW).
TEST_F(RanksAsProcesses, ShardedRunsOneAfterAnotherInAProcessTrainAsFreshProcesses) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"level=O2 shard=1", {"sgd", "adam", "adamw", "adagrad", "rmsprop", "fused_adam", "fused_adamw", "fused_sgd"}},
      {"level=O2 shard=1 shard_weights=1", {"adam", "fused_adamw", "adam"}}};
  for (const auto& [args, optimizers] : cases) {
    std::string list;
    for (const auto& name : optimizers) list += (list.empty() ? "" : ",") + name;
    const int phases = static_cast<int>(optimizers.size());
    const auto in_one_process =
        run_ranks_phases(2, args + " optimizers=" + list + " phases=" + std::to_string(phases), phases);
    for (int phase = 0; phase < phases; ++phase) {
      expect_same_bits(in_one_process[phase], run_ranks(2, args + " optimizer=" + optimizers[phase]),
                       args + ", phase " + std::to_string(phase) + " (" + optimizers[phase] + ") vs a fresh process");
    }
  }
}

// (opt level, world size, optimizer, bucket bytes)
class ShardedDataParallel
    : public AmpTest, public ::testing::WithParamInterface<std::tuple<std::string, int, std::string, int>> {};

TEST_P(ShardedDataParallel, TrainsBitForBitAsReplicated) {
  // Elementwise optimizers and Gloo's reduce-scatter (the all-reduce's
  // chunk) leave no arithmetic to reorder: each step's float32 masters,
  // gathered from the shards, equal the replicated run's bit for bit.
  // 64-byte buckets make shards uneven, with parameters straddling them;
  // 1-byte buckets (one per parameter) at world size 4 pad fc2.bias's 2
  // elements to 4, so ranks 2 and 3 hold no piece of it.
  const auto& [level, world, optimizer, bucket_bytes] = GetParam();
  const std::string args = "level=" + level + " optimizer=" + optimizer + " bucket_bytes=" + std::to_string(bucket_bytes);
  const auto sharded = run_ranks(world, args + " shard=1");
  const auto replicated = run_ranks(world, args);
  if (optimizer.rfind("fused_", 0) == 0) {
    // ATen's fused CPU kernels round the vectorized body and the scalar tail
    // of each tensor apart by an ulp, and pieces end where tensors do not.
    EXPECT_LE(max_distance(sharded, replicated), 1e-7);
    EXPECT_EQ(sharded[0].skipped, replicated[0].skipped);
  } else {
    expect_same_bits(sharded, replicated, "sharded vs replicated");
  }
  for (size_t r = 1; r < sharded.size(); ++r) expect_same_bits({sharded[r]}, {sharded[0]}, "rank " + std::to_string(r));
  if (optimizer == "sgd") expect_trained_together(sharded, 3 * one_process_error(level));
}

INSTANTIATE_TEST_SUITE_P(LevelsWorldSizesOptimizers, ShardedDataParallel,
                         ::testing::Values(std::make_tuple("O2", 1, "adam", 64), std::make_tuple("O2", 2, "sgd", 64),
                                           std::make_tuple("O2", 3, "fused_adamw", 64), std::make_tuple("O2", 4, "adam", 1),
                                           std::make_tuple("O5", 3, "sgd", 64), std::make_tuple("O5", 4, "adamw", 64),
                                           std::make_tuple("O2", 2, "adagrad", 64), std::make_tuple("O2", 3, "rmsprop", 64)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world_size_" + std::to_string(std::get<1>(info.param)) +
                                  "_" + std::get<2>(info.param) + "_buckets_of_" +
                                  std::to_string(std::get<3>(info.param)) + "_bytes";
                         });

// Recomputed layers under sharding: the weights a rerun meets in backward
// are the ones forward gathered, and gradients reach the reduce-scatter
// hooks through the recompute node: the same bits as without it, with
// accumulation too.
TEST_F(RanksAsProcesses, ShardedTrainingWithRecomputedLayersIsBitIdentical) {
  for (const std::string level : {"O2", "O5", "O6"}) {
    const std::string optimizer = level == "O6" ? "fused_adamw" : "adam";
    const std::string args = "level=" + level + " optimizer=" + optimizer + " shard=1 micro_batches=2";
    expect_same_bits(run_ranks(2, args + " recompute=1"), run_ranks(2, args), level);
  }
}

// The fp8 property under sharding: each rank scales its own operands (its
// rows' amaxes), the gathered weights are quantized once an iteration, and
// the one rank's overflow - an inf gradient entering a float8 GEMM - is
// skipped everywhere. Sharded equals replicated bit for bit, and float8
// moved the weights differently from O5's bfloat16 (it ran).
// A weight read through a view before any op amp casts (Python's pos[:n])
// trains the same bits as the same read after the layers, sharded and
// replicated, with the layers recomputed or not: the view gathers (or
// lowers) the weights first.
TEST_F(RanksAsProcesses, AWeightReadThroughAViewFirstTrainsAsReadAfter) {
  for (const char* level : {"O5", "O2"}) {
    for (const char* shard : {" shard=1", ""}) {
      const std::string args = std::string("level=") + level + " optimizer=adam" + shard;
      const auto after = run_ranks(2, args + " positions=after");
      expect_same_bits(run_ranks(2, args + " positions=first"), after, args + " first");
      expect_same_bits(run_ranks(2, args + " positions=first recompute=1"), after, args + " first, recomputed");
    }
  }
}

TEST_F(RanksAsProcesses, ShardedFloat8TrainingIsBitForBitAsReplicated) {
  const std::string args = "level=O5 fp8=1 optimizer=sgd";
  const auto sharded = run_ranks(2, args + " shard=1");
  expect_same_bits(sharded, run_ranks(2, args), "sharded vs replicated");
  expect_same_bits({sharded[1]}, {sharded[0]}, "rank 1");
  EXPECT_EQ(sharded[0].skipped, 1);
  const auto bfloat16 = run_ranks(2, "level=O5 optimizer=sgd shard=1");
  const double moved = (sharded[0].steps.back() - sharded[0].steps.front()).abs().max().item<double>();
  EXPECT_GT(max_distance(sharded, bfloat16), 0);
  // e5m2 gradients round each element by up to 1/8: the runs part by a
  // fraction of what training moved, not by drift.
  EXPECT_LE(max_distance(sharded, bfloat16), 0.25 * moved);
}

// O6 sharded: the pieces are the bfloat16 weights themselves, stepped by
// amp's fused AdamW with stochastic rounding, each rank drawing its own
// stream. Ranks agree, the overflow is skipped everywhere, the run stays
// within a few bf16 roundings of the replicated one (the noise differs),
// and a checkpoint resumes every rank's rounding bit for bit.
TEST_F(RanksAsProcesses, ShardedMastersFreeTrainingAgreesAndResumesBitForBit) {
  const std::string args = "level=O6 optimizer=fused_adamw";
  const auto sharded = run_ranks(3, args + " shard=1");
  for (size_t r = 1; r < sharded.size(); ++r) expect_same_bits({sharded[r]}, {sharded[0]}, "rank " + std::to_string(r));
  EXPECT_EQ(sharded[0].skipped, 1);
  const auto replicated = run_ranks(3, args);
  const double moved = (sharded[0].steps.back() - sharded[0].steps.front()).abs().max().item<double>();
  EXPECT_GT(moved, 0.01);
  EXPECT_LE(max_distance(sharded, replicated), 0.25 * moved);
  EXPECT_GT(max_distance(sharded, replicated), 0);  // other noise: not the replicated run

  const std::string file = ::testing::TempDir() + "amp_sharded_o6_" + std::to_string(::getpid()) + ".pt";
  const std::string saving = args + " shard=1 checkpoint=" + file + " save_after=1";
  auto tail = run_ranks(2, saving);
  tail[0].steps.erase(tail[0].steps.begin(), tail[0].steps.begin() + 2);
  expect_same_bits(run_ranks(2, saving + " resume=1"), tail, "resumed at world size 2");
  std::remove(file.c_str());
}

// 8-bit state sharded: each rank packs its pieces' moments (a hidden layer
// of 2048 makes the first weight's pieces big enough to pack; the second's
// keep float32 state). Ranks agree, the run stays near the replicated
// 8-bit one (other rounding noise), and a checkpoint - the whole state
// unpacked, as one process writes it - resumes every rank bit for bit: the
// pieces pack again into the same bytes.
TEST_F(RanksAsProcesses, ShardedEightBitStateAgreesAndResumesBitForBit) {
  for (const char* level : {"O2", "O6"}) {
    SCOPED_TRACE(level);
    const std::string args = std::string("level=") + level + " optimizer=fused_adamw state8=1 hidden=2048 bucket_bytes=1048576";
    const auto sharded = run_ranks(2, args + " shard=1");
    expect_same_bits({sharded[1]}, {sharded[0]}, "rank 1");
    EXPECT_EQ(sharded[0].skipped, 1);
    // Adam's first steps move each weight about lr = 0.01 whatever its
    // gradient, so a moment rounded to another code moves a weight by up to
    // lr: on average the runs stay together.
    const auto replicated = run_ranks(2, args);
    expect_same_bits({replicated[1]}, {replicated[0]}, "replicated rank 1");  // rank 0's rounding stream
    const at::Tensor last = sharded[0].steps.back(), start = sharded[0].steps.front();
    const double moved = (last - start).abs().mean().item<double>();
    const double apart = (last - replicated[0].steps.back()).abs().mean().item<double>();
    EXPECT_GT(moved, 0.01);
    EXPECT_LE(apart, 0.15 * moved);

    const std::string file = ::testing::TempDir() + "amp_sharded_8bit_" + std::to_string(::getpid()) + ".pt";
    const std::string saving = args + " shard=1 checkpoint=" + file + " save_after=1";
    auto tail = run_ranks(2, saving);
    tail[0].steps.erase(tail[0].steps.begin(), tail[0].steps.begin() + 2);
    expect_same_bits(run_ranks(2, saving + " resume=1"), tail, "resumed at world size 2");
    std::remove(file.c_str());
  }
}

// Replicas round with rank 0's seed: ranks seeded apart still step alike.
TEST_F(RanksAsProcesses, ReplicatedMastersFreeRanksRoundAlike) {
  const auto ranks = run_ranks(2, "level=O6 optimizer=fused_adamw seed_per_rank=1");
  expect_same_bits({ranks[1]}, {ranks[0]}, "rank 1");
}

TEST_F(RanksAsProcesses, ShardedOverGlooWithCudaTensors) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  // One GPU: two ranks share it over Gloo, amp's fused AdamW skipping on the device.
  const std::string args = "device=cuda optimizer=fused_adamw";
  const auto sharded = run_ranks(2, args + " shard=1");
  EXPECT_LE(max_distance(sharded, run_ranks(2, args)), 1e-6);  // fused kernels over pieces, not whole tensors
  expect_same_bits({sharded[1]}, {sharded[0]}, "rank 1");
  EXPECT_EQ(sharded[0].skipped, 1);
  // O6: the bfloat16 pieces rounded on the device by each rank's stream.
  const auto masters_free = run_ranks(2, args + " level=O6 shard=1");
  expect_same_bits({masters_free[1]}, {masters_free[0]}, "O6 rank 1");
  EXPECT_EQ(masters_free[0].skipped, 1);
}

// amp's data parallelism over NCCL: a world of one rank, replicated and
// sharded, at O2 and O6, trains as one process does without a group.
TEST_F(RanksAsProcesses, NcclWithCudaTensorsOneRankTrainsAsOneProcess) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
#ifndef AMP_WITH_NCCL
  FAIL() << "LibTorch has CUDA here, but the build found no nccl.h (tests/CMakeLists.txt, AMP_NCCL_INCLUDE_DIR)";
#endif
  for (const std::string level : {"O2", "O6"}) {
    const std::string args = "device=cuda optimizer=fused_adamw level=" + level;
    const auto single = run_ranks(1, args + " reduce=none")[0];
    for (const std::string shard : {"0", "1"}) {
      const auto nccl = run_ranks(1, args + " backend=nccl shard=" + shard)[0];
      expect_same_bits({nccl}, {single}, level + " over NCCL, shard=" + shard);
      EXPECT_EQ(nccl.skipped, single.skipped);
      EXPECT_EQ(nccl.skipped, 1);  // the injected overflow
    }
  }
}

TEST_F(RanksAsProcesses, ShardedAccumulationAtStagesOneAndTwo) {
  // ZeRO-2 keeps no whole gradient between micro-batches: each guard
  // reduce-scatters, and the pieces sum the averages. The order of the sums
  // differs from the replicated run's (which sums locally, then averages):
  // float32 rounding apart, 1e-6, far below the bound against float64.
  // ZeRO-1 (shard_gradients=0) sums each rank's micro-batches in float32 and
  // reduces once, as the replicated run does: bit for bit.
  const auto replicated = run_ranks(3, "micro_batches=2");
  const auto stage2 = run_ranks(3, "micro_batches=2 shard=1");
  expect_trained_together(stage2, 3 * one_process_error("O2"));
  EXPECT_LE(max_distance(stage2, replicated), 1e-6);
  expect_same_bits(run_ranks(3, "micro_batches=2 shard=1 shard_gradients=0"), replicated, "ZeRO-1");
}

TEST_F(RanksAsProcesses, ShardedClippingSpansEveryShard) {
  // amp::clip_grad_norm adds the shards' squares across ranks: the same
  // clipping as the replicated run's up to float32 rounding, and the clip
  // bites (the run moves far from the unclipped one).
  const auto sharded = run_ranks(3, "shard=1 clip=0.05");
  EXPECT_LE(max_distance(sharded, run_ranks(3, "clip=0.05")), 1e-6);
  EXPECT_GT(max_distance(sharded, run_ranks(3, "shard=1")), 1e-3);
  for (size_t r = 1; r < sharded.size(); ++r) expect_same_bits({sharded[r]}, {sharded[0]}, "rank " + std::to_string(r));
}

TEST_F(RanksAsProcesses, ShardedCheckpointResumesAtAnyWorldSize) {
  // A sharded run at world size 2 saves after step 1 (whole state, as one
  // process writes it); resumed at world sizes 3 and 1 it trains on bit for
  // bit as an unsharded run resumed from the same file, and at world size 2
  // as the run that never stopped.
  const std::string file = ::testing::TempDir() + "amp_sharded_" + std::to_string(::getpid()) + ".pt";
  const std::string saving = "optimizer=adam checkpoint=" + file + " save_after=1";
  const auto uninterrupted = run_ranks(2, saving + " shard=1");
  const std::string resume = saving + " resume=1";
  expect_same_bits(run_ranks(3, resume + " shard=1"), run_ranks(3, resume), "world size 3");
  expect_same_bits(run_ranks(1, resume + " shard=1"), run_ranks(1, resume + " reduce=none"), "world size 1");
  auto resumed = run_ranks(2, resume + " shard=1");
  auto tail = uninterrupted;
  tail[0].steps.erase(tail[0].steps.begin(), tail[0].steps.begin() + 2);
  expect_same_bits(resumed, tail, "world size 2");
  std::remove(file.c_str());
}

// ZeRO-3 (data_parallel.shard_weights): each rank keeps only its pieces of
// the weights and gathers them op by op - recomputed blocks free theirs when
// their forward ends and gather them again for the rerun in backward. The
// gathered values are the pieces', so every step's float32 masters equal
// ZeRO-2's bit for bit: O2, O5 (also with fp8) and O6, with and without
// recomputation, with accumulation, uneven shards at world size 3, and an
// evaluation on every rank after each step (its outputs join the trace).
TEST_F(RanksAsProcesses, ShardedWeightsTrainBitForBitAsShardedMasters) {
  const std::vector<std::pair<int, std::string>> runs = {
      {2, "level=O5 optimizer=adam recompute=1"},
      {2, "level=O5 optimizer=adam recompute=0 evaluate=1"},
      {2, "level=O2 optimizer=sgd recompute=1 micro_batches=2 evaluate=1"},
      {2, "level=O6 optimizer=fused_adamw recompute=1"},
      {2, "level=O5 optimizer=adam recompute=1 fp8=1"},
      {3, "level=O2 optimizer=fused_adamw recompute=1 bucket_bytes=1 positions=first"},
  };
  for (const auto& [world, args] : runs) {
    SCOPED_TRACE(args);
    const auto zero3 = run_ranks(world, args + " shard=1 shard_weights=1");
    expect_same_bits(zero3, run_ranks(world, args + " shard=1"), "shard_weights vs shard");
    for (int r = 1; r < world; ++r) expect_same_bits({zero3[r]}, {zero3[0]}, "rank " + std::to_string(r));
  }
}

// The step inside backward with sharding: each rank steps its pieces of a
// bucket as soon as the bucket's reduce-scatter is averaged, during
// backward. At world size 2 ZeRO-3 and ZeRO-2 with the step in backward
// train bit for bit as ZeRO-2's ordinary step: O6 with AdamW (8-bit state
// too) and SGD, recomputed or not; uneven shards at world 3.
TEST_F(RanksAsProcesses, ShardedStepInBackwardTrainsBitForBitAsTheOrdinaryStep) {
  const std::vector<std::pair<int, std::string>> runs = {
      {2, "optimizer=fused_adamw recompute=1"},
      {2, "optimizer=fused_adamw recompute=0 state8=1 hidden=2048 bucket_bytes=1048576"},
      {3, "optimizer=fused_sgd recompute=1 bucket_bytes=1"},
  };
  for (const auto& [world, run] : runs) {
    SCOPED_TRACE(run);
    const std::string args = "level=O6 static_scale=1 shard=1 " + run;
    const auto ordinary = run_ranks(world, args);
    EXPECT_FALSE(BitEqual(ordinary[0].steps.back(), ordinary[0].steps.front())) << "the steps moved the weights";
    expect_same_bits(run_ranks(world, args + " shard_weights=1 step_in_backward=1"), ordinary, "ZeRO-3");
    expect_same_bits(run_ranks(world, args + " step_in_backward=1"), ordinary, "ZeRO-2");
  }
}

// A ZeRO-3 run saves after step 1 (whole weights and state, as one process
// writes them); resumed at world sizes 3 and 1, sharded or not, it trains
// on as an unsharded run resumed from the same file, bit for bit.
TEST_F(RanksAsProcesses, ShardedWeightsCheckpointResumesAtAnyWorldSize) {
  const std::string file = ::testing::TempDir() + "amp_zero3_" + std::to_string(::getpid()) + ".pt";
  const std::string saving = "optimizer=adam recompute=1 checkpoint=" + file + " save_after=1";
  const auto uninterrupted = run_ranks(2, saving + " shard=1 shard_weights=1");
  const std::string resume = saving + " resume=1";
  expect_same_bits(run_ranks(3, resume + " shard=1 shard_weights=1"), run_ranks(3, resume), "world size 3");
  expect_same_bits(run_ranks(1, resume + " shard=1 shard_weights=1"), run_ranks(1, resume + " reduce=none"),
                   "world size 1");
  auto tail = uninterrupted;
  tail[0].steps.erase(tail[0].steps.begin(), tail[0].steps.begin() + 2);
  expect_same_bits(run_ranks(2, resume + " shard=1 shard_weights=1"), tail, "world size 2");
  std::remove(file.c_str());
}

// What rank 0's forward alone came to (dist_helper's alone_forward), read
// and removed: run_ranks names rank 0's output after its run counter.
std::string read_alone_outcome() {
  std::string found;
  for (const auto& entry : std::filesystem::directory_iterator(::testing::TempDir())) {
    const std::string name = entry.path().string();
    if (name.size() > 6 && name.compare(name.size() - 6, 6, ".alone") == 0 &&
        name.find("amp_dist_out_" + std::to_string(::getpid())) != std::string::npos) {
      std::ifstream in(name);
      found.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      std::remove(name.c_str());
    }
  }
  return found;
}

// A forward on rank 0 alone (evaluation, sampling) while the others are
// elsewhere: after amp's fused step the weights are already gathered, so it
// needs no collective and reads the stepped weights; after LibTorch's own
// step it would wait at the weights' all-gather for ranks that never come,
// and stops within gather_timeout with an error that says what to do (the
// others then meet it at the gather of their next forward, masters_of's).
TEST_F(RanksAsProcesses, ShardedForwardOnOneRankWorksOrFailsFast) {
  for (const std::string level : {"O2", "O5"}) {
    for (const std::string optimizer : {"fused_adamw", "adam"}) {
      const std::string args = "level=" + level + " optimizer=" + optimizer +
                               " shard=1 alone_forward=1 gather_timeout_ms=1500";  // the others come after 2.5 s
      run_ranks(2, args);
      const std::string found = read_alone_outcome();
      SCOPED_TRACE(level + " " + optimizer + ": " + found);
      if (optimizer == "fused_adamw") {
        EXPECT_EQ(found, "same");
      } else {
        ASSERT_EQ(found.rfind("error ", 0), 0u);
        EXPECT_LT(std::stod(found.substr(6)), 2.5) << "fails within seconds, before the others come";
        EXPECT_THAT(found, ::testing::HasSubstr("Every rank must run that forward"));
        EXPECT_THAT(found, ::testing::HasSubstr("FusedAdamW"));
      }
    }
  }
}

// With shard_weights every forward gathers, amp's fused optimizers
// included: a forward on rank 0 alone stops within gather_timeout with the
// error that says so, having started nothing.
TEST_F(RanksAsProcesses, ShardedWeightsForwardOnOneRankFailsFast) {
  run_ranks(2, "level=O5 optimizer=fused_adamw shard=1 shard_weights=1 alone_forward=1 gather_timeout_ms=1500");
  const std::string found = read_alone_outcome();
  SCOPED_TRACE(found);
  ASSERT_EQ(found.rfind("error ", 0), 0u);
  EXPECT_LT(std::stod(found.substr(6)), 2.5) << "fails within seconds, before the others come";
  EXPECT_THAT(found, ::testing::HasSubstr("every forward runs for the weights it reads"));
  EXPECT_THAT(found, ::testing::HasSubstr("Nothing was started"));
}

// The program's own pattern, `if (rank == 0) evaluate(model); barrier();`,
// with LibTorch's optimizer and a group whose own timeout (4 s) is far
// below gather_timeout (60 s): rank 0's forward stops with amp's error
// within half the group's timeout, having started nothing, so the barrier
// and the next step work on every rank, and train the same bits as the same
// program without rank 0's forward.
TEST_F(RanksAsProcesses, ShardedForwardOnOneRankBeforeABarrierLeavesTheGroupWorking) {
  const std::string args = "level=O5 optimizer=adam shard=1 alone_forward=2 group_timeout_ms=4000";
  const auto with_forward = run_ranks(2, args);
  const std::string found = read_alone_outcome();
  SCOPED_TRACE(found);
  ASSERT_EQ(found.rfind("error ", 0), 0u);
  EXPECT_LT(std::stod(found.substr(6)), 3.0) << "within half the group's timeout (2 s), and some slack";
  EXPECT_THAT(found, ::testing::HasSubstr("Nothing was started"));
  EXPECT_THAT(found, ::testing::HasSubstr("half the process group's own timeout of 4000 ms"));
  const auto without = run_ranks(2, args + " lone=0");
  (void)read_alone_outcome();
  expect_same_bits(with_forward, without, "with and without rank 0's lone forward");
  EXPECT_TRUE(BitEqual(with_forward[1].steps.back(), with_forward[0].steps.back()));
}

// ---- In one process: a process group of one rank ----------------------------

Options fake_data_parallel(Options options, c10::intrusive_ptr<WorldOfOne> group = c10::make_intrusive<WorldOfOne>()) {
  options.verbosity = 0;
  options.data_parallel.group = group;
  options.data_parallel.bucket_bytes = 64;
  return options;
}

// The message amp::initialize refuses with (amp stays uninitialized), or
// "initialized".
std::string initialize_refusal(TinyNet& model, torch::optim::Optimizer& optimizer, const Options& options) {
  try {
    amp::initialize(model, optimizer, options);
  } catch (const c10::Error& e) {
    EXPECT_FALSE(amp::is_initialized());
    return e.what_without_backtrace();
  }
  return "initialized";
}

TEST_F(AmpTest, DataParallelLeavesParametersWithoutGradientsWithout) {
  torch::manual_seed(0);
  TinyNet model;
  auto unused = model->register_parameter("unused", torch::ones({3}));
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  amp::initialize(model, optimizer, fake_data_parallel(O2));
  optimizer.zero_grad();
  {
    amp::scale_loss scaled(model->forward(torch::randn({4, 8})).sum(), optimizer);
    scaled.backward();
  }
  EXPECT_FALSE(unused.grad().defined());
  EXPECT_TRUE(model->fc1->weight.grad().defined());
  EXPECT_EQ(model->fc1->weight.grad().scalar_type(), torch::kFloat);
}

// Named as Gloo, a world of one takes the sharded path that all-reduces
// whole buckets (gradient_reducer.cpp): flags and overflow from the sums.
struct GlooNamedWorldOfOne : WorldOfOne {
  const std::string getBackendName() const override { return "gloo"; }
};

TEST_F(AmpTest, ShardedWholeSumsKeepUnusedParametersWithoutGradientsAndSeeOverflows) {
  int buckets = 0;
  for (const bool gloo : {false, true}) {
    SCOPED_TRACE(gloo ? "all-reduced buckets" : "reduce-scattered buckets");
    torch::manual_seed(0);
    TinyNet model;
    auto unused = model->register_parameter("unused", torch::ones({3}));
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    c10::intrusive_ptr<WorldOfOne> group = c10::make_intrusive<WorldOfOne>();
    if (gloo) group = c10::make_intrusive<GlooNamedWorldOfOne>();
    Options options = fake_data_parallel(O2, group);
    options.data_parallel.shard = true;
    Handle handle;
    handle.initialize(model, optimizer, options);
    const int allreduces = group->allreduces.load();
    optimizer.zero_grad();
    {
      scale_loss scaled(model->forward(torch::randn({4, 8})).to(at::kFloat).sum(), optimizer);
      scaled.backward();
    }
    // Reduce-scattered: a reduce-scatter per bucket, then the used flags'
    // and the overflow's all-reduces. All-reduced: one per bucket (those
    // ready together in one), nothing else.
    if (!gloo) buckets = group->reduce_scatters.load();
    EXPECT_GE(buckets, 2);
    if (gloo) {
      EXPECT_GE(group->allreduces.load() - allreduces, 1);
      EXPECT_LE(group->allreduces.load() - allreduces, buckets);
    } else {
      EXPECT_EQ(group->allreduces.load() - allreduces, 2);
    }
    EXPECT_EQ(group->reduce_scatters.load(), gloo ? 0 : buckets);
    const auto pieces = amp::master_params(optimizer);
    int with_gradient = 0, without = 0;
    for (const auto& p : pieces) (p.grad().defined() ? with_gradient : without)++;
    EXPECT_EQ(without, 1) << "the unused parameter's piece";
    EXPECT_EQ(with_gradient, static_cast<int>(pieces.size()) - 1);
    optimizer.step();
    // An inf in the sums skips the step on every rank.
    const auto before = amp::master_params(optimizer)[0].detach().clone();
    optimizer.zero_grad();
    {
      scale_loss scaled(model->forward(torch::randn({4, 8})).to(at::kFloat).sum() * INFINITY, optimizer);
      scaled.backward();
    }
    optimizer.step();
    EXPECT_TRUE(BitEqual(amp::master_params(optimizer)[0], before));
    EXPECT_EQ(amp::skipped_steps(optimizer), 1);
  }
}

// Set when the process begins to exit; a collective after it ends the
// process with code 3.
std::atomic<bool> g_exiting{false};
struct WorldWatchingExit : GlooNamedWorldOfOne {
  static void refuse_at_exit() {
    if (!g_exiting) return;
    std::fputs("a collective ran during exit\n", stderr);
    std::_Exit(3);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    refuse_at_exit();
    return GlooNamedWorldOfOne::allreduce(t, o);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    refuse_at_exit();
    return GlooNamedWorldOfOne::_allgather_base(out, in, o);
  }
};

// A program that exits without deinitializing: the live sharded session is
// not torn down at exit, so no collective runs then (initialize.h), when the
// other ranks may have left and the CUDA runtime may be unloading.
TEST_F(AmpTest, ASessionLiveAtExitRunsNoCollective) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        torch::manual_seed(0);
        static TinyNet model;
        static torch::optim::SGD optimizer(model->parameters(), 0.1);
        Options options = fake_data_parallel(O2, c10::make_intrusive<WorldWatchingExit>());
        options.data_parallel.shard = true;
        amp::initialize(model, optimizer, options);
        optimizer.zero_grad();
        {
          amp::scale_loss scaled(model->forward(torch::randn({4, 8})).sum(), optimizer);
          scaled.backward();
        }
        optimizer.step();
        std::atexit([] { g_exiting = true; });
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(AmpTest, DataParallelBucketsStartWhileBackwardRuns) {
  torch::manual_seed(0);
  TinyNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  auto group = c10::make_intrusive<WorldOfOne>();
  amp::initialize(model, optimizer, fake_data_parallel(O2, group));  // 64-byte buckets
  int started_before_fc1 = -1;
  const auto hidden = model->fc1->forward(torch::randn({4, 8}));
  hidden.register_hook([&](const at::Tensor&) { started_before_fc1 = group->allreduces.load(); });
  const auto loss = model->fc2->forward(torch::relu(hidden)).sum();
  {
    amp::scale_loss scaled(loss, optimizer);
    scaled.backward();
    EXPECT_EQ(group->allreduces.load(), 3);  // fc2's [bias, weight], fc1.bias, fc1.weight
  }
  // When backward reached fc1, fc2's bucket was already on its way.
  EXPECT_EQ(started_before_fc1, 1);
}

TEST_F(AmpTest, DataParallelRefusesTwoBackwardsInOneGuard) {
  torch::manual_seed(0);
  TinyNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  amp::initialize(model, optimizer, fake_data_parallel(O1));
  const auto before = model->fc1->weight.detach().clone();
  const auto loss = model->forward(torch::randn({4, 8})).sum();
  amp::scale_loss scaled(loss, optimizer);
  scaled.backward(/*retain_graph=*/true);
  scaled.backward();
  EXPECT_THAT([&] { scaled.finish(); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("accumulated twice")));
  EXPECT_FALSE(model->fc1->weight.grad().defined());  // the guard unwound
  optimizer.step();
  EXPECT_TRUE(BitEqual(model->fc1->weight, before));
}

TEST_F(AmpTest, DataParallelOptionsAreChecked) {
  torch::manual_seed(0);
  TinyNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  auto refused = [&](const Options& options) { return initialize_refusal(model, optimizer, options); };
  Options both = fake_data_parallel(O2);
  both.reduce_overflow = [](at::Tensor&) {};
  EXPECT_THAT(refused(both), ::testing::HasSubstr("drop reduce_overflow"));
  Options integer = fake_data_parallel(O2);
  integer.data_parallel.reduce_dtype = torch::kInt;
  EXPECT_THAT(refused(integer), ::testing::HasSubstr("float32, float16 or bfloat16"));
  Options no_bytes = fake_data_parallel(O2);
  no_bytes.data_parallel.bucket_bytes = 0;
  EXPECT_THAT(refused(no_bytes), ::testing::HasSubstr("bucket_bytes must be >= 1"));
  torch::nn::Embedding sparse(torch::nn::EmbeddingOptions(10, 4).sparse(true));
  torch::optim::SGD sparse_optimizer(sparse->parameters(), 0.1);
  try {
    amp::initialize(sparse, sparse_optimizer, fake_data_parallel(O1));
    ADD_FAILURE() << "initialized with sparse gradients";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("cannot average in buckets"));
  }
}

Options fake_sharded(Options options) {
  options = fake_data_parallel(options);
  options.data_parallel.shard = true;
  return options;
}

// What a sharded guard and gather hold beyond the weights, on the
// allocator: the pieces' gradients once (sharing the reduced chunks; O6's
// narrowed to bfloat16 as each bucket's reduction ends), not a float32
// average copied out of every chunk at the end; and a gather that holds a
// few buckets at a time, not a second copy of the weights. 32 layers, a
// bucket each, activations of one row.
// A traced sharded step shows the bucket reductions and the weights'
// all-gather under amp's names.
TEST_F(AmpTest, ShardedStepShowsItsCollectivesInATrace) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::Linear(8, 4));
  amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  Handle handle;
  handle.initialize(model, optimizer, fake_sharded(O2));
  const at::Tensor x = torch::randn({4, 8});
  auto step = [&] {
    optimizer.zero_grad();
    {
      scale_loss scaled(model->forward(x).to(at::kFloat).pow(2).mean(), optimizer);
      scaled.backward();
    }
    optimizer.step();
  };
  step();
  const auto ranges = amp_ranges(profiled(step));  // its forward gathers the weights the first step made
  EXPECT_EQ(ranges.count("amp::all-gather of the weights"), 1u);
  EXPECT_GE(ranges.count("amp::reduce-scatter (bucket)"), 2u) << "64-byte buckets: several";
  EXPECT_EQ(ranges.count("amp::fused step"), 1u);
}

// A world of one whose all-gathers complete late, on another thread: the
// weights' gather of a forward must be waited for by the op that reads them.
struct LateWork : c10d::Work {
  LateWork(at::Tensor out, at::Tensor in)
      : future(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {
    copier = std::thread([this, out, in]() mutable {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      out.copy_(in);
      future->markCompleted(c10::IValue(std::vector<at::Tensor>{out}));
      finish();
    });
  }
  ~LateWork() override { copier.join(); }
  bool wait(std::chrono::milliseconds) override {
    future->wait();
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future; }
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::thread copier;
};

struct WorldOfOneWithLateGathers : WorldOfOne {
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions&) override {
    ++gathers;
    return c10::make_intrusive<LateWork>(out, in);
  }
  std::atomic<int> gathers{0};
};

TEST_F(AmpTest, ShardedForwardOpsWaitForTheirOwnBucketsGather) {
  // After LibTorch's step the next forward gathers bucket by bucket: each
  // op waits for its bucket's late all-gather, so its output is the one the
  // gathered weights give (a second forward), not the stale weights'.
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8),
                              torch::nn::ReLU(), torch::nn::Linear(8, 4));
  torch::optim::Adam optimizer(model->parameters(), 1e-1);
  auto group = c10::make_intrusive<WorldOfOneWithLateGathers>();
  Options options = fake_data_parallel(O2, group);  // 64-byte buckets: one per layer
  options.data_parallel.shard = true;
  Handle handle;
  handle.initialize(model, optimizer, options);
  const at::Tensor x = torch::randn({4, 8});
  optimizer.zero_grad();
  at::Tensor before_step;
  {
    const at::Tensor out = model->forward(x);
    before_step = out.detach().clone();
    scale_loss scaled(out.to(at::kFloat).pow(2).mean(), optimizer);
    scaled.backward();
  }
  optimizer.step();
  const int gathers = group->gathers.load();
  const at::Tensor first = model->forward(x);  // gathers, late, while it runs
  EXPECT_EQ(group->gathers.load() - gathers, 3) << "one all-gather per bucket";
  const at::Tensor second = model->forward(x);  // every weight gathered
  EXPECT_EQ(group->gathers.load() - gathers, 3);
  EXPECT_TRUE(BitEqual(first, second));
  EXPECT_FALSE(BitEqual(first, before_step)) << "the step moved the weights";
}

TEST_F(AmpTest, ShardedStepHoldsItsPartOnce) {
  amp::track_allocations();
  for (const Options& level : {O2, O6}) {
    torch::manual_seed(0);
    torch::nn::Sequential model;
    for (int i = 0; i < 32; ++i) model->push_back(torch::nn::Linear(64, 64));
    amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
    Options options = fake_sharded(level);
    options.data_parallel.bucket_bytes = 16 * 1024;
    Handle handle;
    handle.initialize(model, optimizer, options);
    const int64_t params = 32 * (64 * 64 + 64);
    const at::Tensor x = torch::randn({1, 64});
    int64_t guard = 0;
    for (int step = 0; step < 2; ++step) {  // the first creates the optimizer state
      optimizer.zero_grad();
      const at::Tensor loss = model->forward(x).to(at::kFloat).pow(2).mean();
      reset_peak_allocated();
      const int64_t before = allocated_bytes().current;
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      guard = allocated_bytes().peak - before;
      optimizer.step();
    }
    // Per parameter: backward's bf16 gradients (2, released bucket by
    // bucket) and the pieces' (O2: float32 4; O6: 2); a float32 copy of
    // the averages was 4 more.
    EXPECT_LT(guard, (level.opt_level == OptLevel::O6 ? 5 : 7) * params) << to_string(level.opt_level);
    at::NoGradGuard no_grad;
    reset_peak_allocated();
    const int64_t before = allocated_bytes().current;
    model->forward(x);  // gathers the stepped pieces
    // The weights take 2 bytes per parameter; the gather holds a few
    // buckets' wholes at once, not all.
    EXPECT_LT(allocated_bytes().peak - before, params / 2) << to_string(level.opt_level);
  }
}

TEST_F(AmpTest, ShardedOverGlooHoldsNoWholeBucketsWhenBackwardReturns) {
  // Over Gloo amp all-reduces each bucket whole and keeps its chunk; the
  // whole float32 buckets go as their reductions end. When backward returns
  // a rank holds its chunks (here, at world size 1, every gradient once in
  // bfloat16: 2 bytes a parameter), not the float32 buckets (4 more), which
  // a view kept alive until the guard's end.
  amp::track_allocations();
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int i = 0; i < 32; ++i) model->push_back(torch::nn::Linear(64, 64));
  amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  Options options = fake_data_parallel(O6, c10::make_intrusive<GlooNamedWorldOfOne>());
  options.data_parallel.shard = true;
  options.data_parallel.bucket_bytes = 16 * 1024;
  Handle handle;
  handle.initialize(model, optimizer, options);
  const int64_t params = 32 * (64 * 64 + 64);
  optimizer.zero_grad();
  const at::Tensor loss = model->forward(torch::randn({1, 64})).to(at::kFloat).pow(2).mean();
  const int64_t before = allocated_bytes().current;
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();
    EXPECT_LT(allocated_bytes().current - before, 3 * params);
  }
}

TEST_F(AmpTest, ShardedOptimizerStepsPiecesAndGetsItsParametersBack) {
  torch::manual_seed(0);
  TinyNet model;
  torch::optim::Adam optimizer(model->parameters(), 1e-2);
  const auto fc1 = model->fc1->weight;
  {
    amp::Handle amp;
    amp.initialize(model, optimizer, fake_sharded(O2));
    // The model computes in the low dtype; the optimizer steps float32 pieces.
    EXPECT_TRUE(internal::is_low_precision(fc1.scalar_type()));
    for (const auto& p : amp::master_params(optimizer)) {
      EXPECT_EQ(p.scalar_type(), torch::kFloat);
      EXPECT_EQ(p.dim(), 1);
    }
    optimizer.zero_grad();
    {
      amp::scale_loss scaled(model->forward(torch::randn({4, 8})).sum(), optimizer);
      scaled.backward();
    }
    // Released once its bucket was reduced: a mark of no bytes stays (model->zero_grad() resets it).
    ASSERT_TRUE(fc1.grad().defined());
    EXPECT_EQ(fc1.grad().storage().nbytes(), 0u);
    EXPECT_EQ(fc1.grad().sizes(), fc1.sizes());
    optimizer.step();
    const TrainingBytes bytes = training_bytes(optimizer);
    EXPECT_EQ(bytes.masters, 4 * bytes.parameters);          // world size 1: every piece here
    EXPECT_EQ(bytes.optimizer_state, 8 * bytes.parameters);  // Adam's two moments
    EXPECT_EQ(bytes.gradients, 4 * bytes.parameters);
  }
  // Deinitialized: float32 parameters again, stepped by the optimizer with whole state.
  EXPECT_EQ(fc1.scalar_type(), torch::kFloat);
  ASSERT_EQ(optimizer.param_groups()[0].params().size(), model->parameters().size());
  EXPECT_TRUE(optimizer.param_groups()[0].params()[0].is_same(model->parameters()[0]));
  auto& state = static_cast<torch::optim::AdamParamState&>(*optimizer.state().at(fc1.unsafeGetTensorImpl()));
  EXPECT_EQ(state.exp_avg().sizes(), fc1.sizes());
  EXPECT_EQ(state.step(), 1);
}

TEST_F(AmpTest, ShardedTakesTheProgramsOwnTorchLoad) {
  // The program's own restore, as written: torch::load of a float32 file
  // into the (sharded, low-precision) model. The masters take its values
  // exactly, whether read at once or after a forward.
  torch::manual_seed(1);
  TinyNet saved;
  const std::string file = ::testing::TempDir() + "amp_sharded_own_" + std::to_string(::getpid()) + ".pt";
  torch::save(saved, file);
  torch::manual_seed(0);
  TinyNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  amp::initialize(model, optimizer, fake_sharded(O2));
  torch::load(model, file);
  const std::string weights = file + ".fp32";
  amp::save_fp32_weights(model, weights);
  TinyNet read;
  torch::load(read, weights);
  for (size_t i = 0; i < read->parameters().size(); ++i) {
    EXPECT_TRUE(BitEqual(read->parameters()[i], saved->parameters()[i])) << "parameter " << i;
  }
  std::remove(file.c_str());
  std::remove(weights.c_str());
}

TEST_F(AmpTest, ShardedRefusesABackwardOutsideTheGuard) {
  torch::manual_seed(0);
  TinyNet model;
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  amp::initialize(model, optimizer, fake_sharded(O2));
  model->forward(torch::randn({4, 8})).sum().backward();  // the pieces would never see it
  const auto loss = model->forward(torch::randn({4, 8})).sum();
  EXPECT_THAT([&] { amp::scale_loss scaled(loss, optimizer); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("backward ran outside amp::scale_loss")));
}

// ---- ZeRO-3 (shard_weights) in one process ----------------------------------

// Six Linear(8, 8) layers, each its own recomputed block, then a head read
// outside blocks, over a world of one whose all-gathers land 30 ms late;
// 1-byte buckets: an all-gather per parameter, in forward order.
struct Zero3Run {
  torch::nn::Sequential model;
  std::shared_ptr<torch::optim::Adam> optimizer;
  c10::intrusive_ptr<WorldOfOneWithLateGathers> group = c10::make_intrusive<WorldOfOneWithLateGathers>();
  Handle handle;
  // Per block run, in order (forwards, then backward's reruns): which
  // layers held their weight's and bias's bytes after the block's op, and
  // the all-gathers started by then.
  struct Seen {
    size_t block;
    std::vector<bool> whole;
    int gathers;
  };
  std::vector<Seen> seen;

  size_t run_length = 1;  // > 1: runs of this many blocks recomputed around them (two levels)

  explicit Zero3Run(bool shard_weights, size_t run_of = 1) : run_length(run_of) {
    torch::manual_seed(0);
    for (int i = 0; i < 7; ++i) model->push_back(torch::nn::Linear(8, 8));
    optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-2);
    Options options = fake_data_parallel(O5, group);
    options.data_parallel.shard = true;
    options.data_parallel.shard_weights = shard_weights;
    options.data_parallel.bucket_bytes = 1;
    handle.initialize(model, *optimizer, options);
  }
  std::vector<bool> whole() const {
    std::vector<bool> out;
    for (const auto& layer : *model) {
      const auto& linear = layer.get<torch::nn::LinearImpl>();
      out.push_back(linear.weight.storage().nbytes() > 0 && linear.bias.storage().nbytes() > 0);
    }
    return out;
  }
  at::Tensor blocks(size_t begin, size_t end, at::Tensor h) {
    for (size_t k = begin; k < end; ++k) {
      h = amp::recompute(
          [this, k, layer = model->ptr<torch::nn::LinearImpl>(k)](const at::Tensor& in) {
            at::Tensor out = layer->forward(in);
            seen.push_back({k, whole(), group->gathers.load()});
            return out;
          },
          h);
    }
    return h;
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    if (run_length == 1) {
      h = blocks(0, 6, h);
    } else {
      for (size_t begin = 0; begin < 6; begin += run_length) {
        h = amp::recompute([this, begin](const at::Tensor& in) { return blocks(begin, begin + run_length, in); }, h);
      }
    }
    return model->ptr<torch::nn::LinearImpl>(6)->forward(h);
  }
  at::Tensor step(const at::Tensor& x) {
    optimizer->zero_grad();
    const at::Tensor loss = forward(x).to(at::kFloat).pow(2).mean();
    {
      scale_loss scaled(loss, *optimizer);
      scaled.backward();
    }
    optimizer->step();
    return loss.detach();
  }
};

std::vector<bool> only(std::initializer_list<size_t> layers) {
  std::vector<bool> out(7, false);
  for (size_t l : layers) out[l] = true;
  return out;
}

TEST_F(AmpTest, ShardedWeightsAreWholeOnlyWhileTheirRunsNeedThem) {
  Zero3Run run(/*shard_weights=*/true);
  EXPECT_EQ(run.whole(), only({})) << "after initialize a rank holds its pieces alone";
  const at::Tensor x = torch::randn({4, 8});
  run.step(x);
  ASSERT_EQ(run.seen.size(), 12u);
  for (size_t k = 0; k < 6; ++k) {
    // Forward: block k's layer alone; the next layer's two all-gathers travel
    // (into buffers of their own) while it computes.
    const Zero3Run::Seen& forward = run.seen[k];
    EXPECT_EQ(forward.block, k);
    EXPECT_EQ(forward.whole, only({k})) << "forward of block " << k;
    EXPECT_EQ(forward.gathers, static_cast<int>(std::min<size_t>(14, 2 * k + 4))) << "forward of block " << k;
    // Backward reruns the blocks last first: block k's layer and the head
    // (read outside blocks: whole until the guard ends); the rerun started
    // its gathers and the previous block's before it ran.
    const Zero3Run::Seen& rerun = run.seen[11 - k];
    EXPECT_EQ(rerun.block, k);
    EXPECT_EQ(rerun.whole, only({k, 6})) << "rerun of block " << k;
    EXPECT_EQ(rerun.gathers, static_cast<int>(14 + 2 * (6 - k) + (k > 0 ? 2 : 0))) << "rerun of block " << k;
  }
  EXPECT_EQ(run.group->gathers.load(), 26) << "each block's weights gathered once for forward, once for backward";
  EXPECT_EQ(run.whole(), only({})) << "after the guard and the step";
  EXPECT_EQ(training_bytes(*run.optimizer).weights, 0);

  {  // An evaluation gathers every weight, which stays until training's first block
    torch::NoGradGuard no_grad;
    run.forward(x);
  }
  EXPECT_EQ(run.whole(), only({0, 1, 2, 3, 4, 5, 6}));
  run.seen.clear();
  run.step(x);
  EXPECT_EQ(run.seen.front().whole, only({0}));
  EXPECT_EQ(run.whole(), only({}));
}

// Two levels: runs of three blocks, each run recomputed around its
// blocks. A run's rerun runs its blocks' forwards again, as new blocks; the
// prefetch for the next rerun takes only a block backward will rerun, never
// one of the earlier forward's (whose gathers would wait, unread, for the
// guard's end).
TEST_F(AmpTest, ShardedWeightsInRunsOfBlocksGatherOnlyWhatARunReads) {
  Zero3Run run(/*shard_weights=*/true, /*run_of=*/3);
  run.optimizer->zero_grad();
  const at::Tensor loss = run.forward(torch::randn({4, 8})).to(at::kFloat).pow(2).mean();
  {
    scale_loss scaled(loss, *run.optimizer);
    scaled.backward();
    EXPECT_EQ(run.whole(), only({6})) << "when backward returns: the head alone (read outside blocks)";
  }
  // Forward: 7 layers' two all-gathers; backward: each block's again in its
  // run's rerun and once more in its own.
  EXPECT_EQ(run.group->gathers.load(), 14 + 12 + 12);
  // Every forward inside a run's rerun, then the block's own rerun: 6 + 6 + 6.
  ASSERT_EQ(run.seen.size(), 18u);
  for (size_t i = 0; i < run.seen.size(); ++i) {
    const Zero3Run::Seen& s = run.seen[i];
    EXPECT_EQ(s.whole, i < 6 ? only({s.block}) : only({s.block, 6})) << "run " << i << ", block " << s.block;
  }
  run.optimizer->step();
  EXPECT_EQ(run.whole(), only({}));
}

TEST_F(AmpTest, ShardedWeightsOfAKeptGraphStayUntilItsLastBackward) {
  // Two losses of one forward, the first backward keeping the graph: the
  // head's weights (read outside blocks, saved by autograd) stay whole for
  // the second backward, and go when its guard ends.
  Zero3Run run(/*shard_weights=*/true);
  const at::Tensor out = run.forward(torch::randn({4, 8})).to(at::kFloat);
  run.optimizer->zero_grad();
  {
    scale_loss scaled(out.pow(2).mean(), *run.optimizer);
    scaled.backward(/*retain_graph=*/true);
  }
  EXPECT_EQ(run.whole(), only({6}));
  {
    scale_loss scaled(out.abs().mean(), *run.optimizer);
    scaled.backward();
  }
  EXPECT_EQ(run.whole(), only({}));
  run.optimizer->step();
}

TEST_F(AmpTest, ShardedWeightsTrainAsShardedMastersWithLateGathers) {
  // Each op waits for its own late all-gather, never reading a prefetched
  // one before it lands: the losses of three steps equal ZeRO-2's bit for bit.
  std::vector<at::Tensor> losses;
  const at::Tensor x = torch::randn({4, 8});
  {
    Zero3Run zero3(/*shard_weights=*/true);
    for (int step = 0; step < 3; ++step) losses.push_back(zero3.step(x));
  }
  Zero3Run zero2(/*shard_weights=*/false);
  for (int step = 0; step < 3; ++step) EXPECT_TRUE(BitEqual(zero2.step(x), losses[step])) << "step " << step;
}

TEST_F(AmpTest, ShardedWeightsOptionsAreChecked) {
  torch::manual_seed(0);
  TinyNet model;
  torch::optim::SGD sgd(model->parameters(), 0.1);
  Options without_shard = fake_data_parallel(O2);
  without_shard.data_parallel.shard_weights = true;
  EXPECT_THAT(initialize_refusal(model, sgd, without_shard), ::testing::HasSubstr("set shard = true too"));
  const at::Tensor flat = torch::randn({20});
  model->register_parameter("part", flat.narrow(0, 0, 10));  // a view of a flat buffer
  torch::optim::SGD with_view(model->parameters(), 0.1);
  Options zero3 = fake_sharded(O2);
  zero3.data_parallel.shard_weights = true;
  EXPECT_THAT(initialize_refusal(model, with_view, zero3), ::testing::HasSubstr("shares its storage"));
  EXPECT_EQ(model->fc1->weight.scalar_type(), torch::kFloat);  // nothing changed
}

// model->zero_grad() finds no gradient on a sharded model's parameters
// (backward's went to the shards), so amp leaves a mark of no bytes on each
// after a guard: where the model's zero_grad reset it, the next guard resets
// the shard's gradient too. Without that the shards would add up every
// step's gradients.
TEST_F(AmpTest, ShardedZeroGradThroughTheModelOrTheOptimizerTrainsAlike) {
  for (const bool weights : {false, true}) {
  SCOPED_TRACE(weights ? "ZeRO-3" : "ZeRO-2");
  std::vector<at::Tensor> finals;
  for (const bool through_model : {false, true}) {
    torch::manual_seed(0);
    TinyNet model;
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    Options options = fake_sharded(O2);
    options.data_parallel.shard_weights = weights;
    Handle handle;
    handle.initialize(model, optimizer, options);
    for (int step = 0; step < 3; ++step) {
      through_model ? model->zero_grad() : optimizer.zero_grad();
      {
        scale_loss scaled(model->forward(torch::randn({4, 8})).to(at::kFloat).pow(2).mean(), optimizer);
        scaled.backward();
      }
      optimizer.step();
    }
    std::vector<at::Tensor> parts;
    for (const auto& p : master_params(optimizer)) parts.push_back(p.detach().flatten().clone());
    finals.push_back(torch::cat(parts));
  }
  EXPECT_TRUE(BitEqual(finals[0], finals[1]));
  }
}

// ---- The step inside backward, sharded ---------------------------------------

// O6 + step_in_backward sharded (ZeRO-2, and ZeRO-3 with shard_weights):
// each bucket's pieces are stepped as soon as the bucket's reduction is
// averaged, while backward goes on, and their gradients go with the chunk.
// The pieces train bit for bit as ZeRO-2's ordinary step (8-bit state too),
// and when backward returns a rank holds a few buckets' gradients, not its
// part of every gradient (2 bytes a parameter at world size 1).
TEST_F(AmpTest, ShardedStepInBackwardStepsEachBucketAsItIsReduced) {
  amp::track_allocations();
  const int64_t params = 32 * (64 * 64 + 64);
  const at::Tensor x = torch::randn({2, 64});
  struct Run {
    bool in_backward, shard_weights, eight_bit;
  };
  auto train = [&](Run run, int64_t* held_after_backward) {
    torch::manual_seed(0);
    torch::nn::Sequential model;
    for (int i = 0; i < 32; ++i) model->push_back(torch::nn::Linear(64, 64));
    amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    Options options = fake_sharded(O6);
    options.data_parallel.bucket_bytes = 16 * 1024;  // 2 layers a bucket
    options.data_parallel.shard_weights = run.shard_weights;
    options.step_in_backward = run.in_backward;
    if (run.eight_bit) options.optimizer_state_dtype = at::kByte;
    Handle handle;
    handle.initialize(model, optimizer, options);
    std::vector<at::Tensor> steps;
    for (int step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      const at::Tensor loss = model->forward(x).to(at::kFloat).pow(2).mean();
      const int64_t before = allocated_bytes().current;
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
        if (held_after_backward) *held_after_backward = allocated_bytes().current - before;
      }
      optimizer.step();
      std::vector<at::Tensor> parts;
      for (const auto& p : master_params(optimizer)) {
        EXPECT_FALSE(run.in_backward && p.grad().defined()) << "applied gradients are freed";
        parts.push_back(p.detach().to(at::kFloat).flatten().clone());
      }
      steps.push_back(torch::cat(parts));
    }
    return steps;
  };
  for (const bool eight_bit : {false, true}) {
    SCOPED_TRACE(eight_bit ? "8-bit state" : "bfloat16 state");
    const std::vector<at::Tensor> ordinary = train({false, false, eight_bit}, nullptr);
    for (const bool shard_weights : {false, true}) {
      SCOPED_TRACE(shard_weights ? "ZeRO-3" : "ZeRO-2");
      int64_t held = 0;
      const std::vector<at::Tensor> in_backward = train({true, shard_weights, eight_bit}, &held);
      for (size_t step = 0; step < ordinary.size(); ++step) {
        EXPECT_TRUE(BitEqual(in_backward[step], ordinary[step])) << "step " << step;
      }
      EXPECT_FALSE(BitEqual(in_backward.back(), in_backward.front())) << "the steps moved the weights";
      // 16 buckets of 2 layers; at most 3 wait for their reduction.
      EXPECT_LT(held, params / 2) << "bytes held when backward returned";
    }
  }
}

// An accumulation's sums live in one place, each optimizer's record: a
// micro-batch's guard that throws takes only its own backward with it,
// replicated, ZeRO-1 (whose float32 sums the record holds between guards)
// and ZeRO-2 alike; a step() while accumulating changes nothing, and the
// accumulation ends bit for bit as one that never ran the failed micro-batch.
TEST_F(AmpTest, DataParallelAccumulationKeepsItsSumThroughAFailedMicroBatch) {
  torch::manual_seed(1);
  const std::vector<at::Tensor> micro = {torch::randn({4, 8}), torch::randn({4, 8}), torch::randn({4, 8})};
  struct Stage {
    const char* name;
    bool shard, shard_gradients;
  };
  for (const Stage& stage : {Stage{"replicated", false, true}, Stage{"ZeRO-1", true, false}, Stage{"ZeRO-2", true, true}}) {
    SCOPED_TRACE(stage.name);
    std::vector<at::Tensor> finals;
    for (const bool fail : {false, true}) {
      torch::manual_seed(0);
      TinyNet model;
      torch::optim::SGD optimizer(model->parameters(), 0.1);
      Options options = fake_data_parallel(O2);
      options.data_parallel.shard = stage.shard;
      options.data_parallel.shard_gradients = stage.shard_gradients;
      Handle handle;
      handle.initialize(model, optimizer, options);
      auto accumulate = [&](const at::Tensor& x, bool last) {
        scale_loss scaled(model->forward(x).to(at::kFloat).pow(2).mean(), optimizer, {0, /*delay_unscale=*/!last});
        scaled.backward();
      };
      optimizer.zero_grad();
      accumulate(micro[0], false);
      if (fail) {
        try {
          scale_loss scaled(model->forward(micro[1]).to(at::kFloat).pow(2).mean(), optimizer, {0, true});
          scaled.backward();
          throw std::runtime_error("the data loader failed");
        } catch (const std::runtime_error& e) {
          EXPECT_STREQ(e.what(), "the data loader failed");
        }
      }
      std::vector<at::Tensor> before;
      for (const auto& p : master_params(optimizer)) before.push_back(p.detach().clone());
      optimizer.step();  // still accumulating: sees no gradients
      const auto masters = master_params(optimizer);
      for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(BitEqual(masters[i], before[i])) << "param " << i;
      accumulate(micro[2], true);
      optimizer.step();
      std::vector<at::Tensor> parts;
      for (size_t i = 0; i < masters.size(); ++i) {
        EXPECT_FALSE(BitEqual(masters[i], before[i])) << "param " << i << " must have stepped";
        parts.push_back(masters[i].detach().flatten().clone());
      }
      finals.push_back(torch::cat(parts));
    }
    EXPECT_TRUE(BitEqual(finals[0], finals[1]));
  }
}

TEST_F(AmpTest, ShardedOptionsAreChecked) {
  torch::manual_seed(0);
  TinyNet model;
  auto refused = [&](torch::optim::Optimizer& optimizer, const Options& options) {
    return initialize_refusal(model, optimizer, options);
  };
  torch::optim::SGD sgd(model->parameters(), 0.1);
  Options no_group = O2;
  no_group.data_parallel.shard = true;
  EXPECT_THAT(refused(sgd, no_group), ::testing::HasSubstr("needs data_parallel.group"));
  EXPECT_THAT(refused(sgd, fake_sharded(O1)), ::testing::HasSubstr("Use O2, O5 or O6"));
  Options nearest = fake_sharded(O6);  // LibTorch's own step on the model's bf16 weights
  nearest.stochastic_rounding = false;
  EXPECT_THAT(refused(sgd, nearest), ::testing::HasSubstr("Use O2, O5 or O6"));
  torch::optim::LBFGS lbfgs(model->parameters());
  EXPECT_THAT(refused(lbfgs, fake_sharded(O2)), ::testing::HasSubstr("SGD, Adam, AdamW"));
  torch::optim::SGD twice({torch::optim::OptimizerParamGroup(model->parameters()),
                           torch::optim::OptimizerParamGroup({model->fc1->weight})},
                          torch::optim::SGDOptions(0.1));
  EXPECT_THAT(refused(twice, fake_sharded(O2)), ::testing::HasSubstr("two parameter groups"));
  torch::optim::Adam stepped(model->parameters(), 1e-2);
  model->forward(torch::randn({4, 8})).sum().backward();
  stepped.step();
  EXPECT_THAT(refused(stepped, fake_sharded(O2)), ::testing::HasSubstr("already holds state"));
  EXPECT_EQ(model->fc1->weight.scalar_type(), torch::kFloat);  // nothing changed
  EXPECT_EQ(stepped.param_groups()[0].params().size(), model->parameters().size());
}

}  // namespace
}  // namespace amp::testing
