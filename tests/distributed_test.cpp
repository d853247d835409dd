// Data-parallel training over ProcessGroupGloo on loopback, ranks started as
// processes (dist_helper). Every run trains 5 steps on a global batch of 24
// rows split across the ranks; the last rank alone overflows at step 2.
//
// Built in (Options::data_parallel): at world sizes 1-4 the replicas stay
// bit-identical, every rank skips step 2, and the parameters follow a
// float64 run of the global batch; world size 1 equals one process without
// a group bit for bit; bucket sizes do not change a bit. The loops that
// average gradients themselves (overflow_all_reduce) are checked as before.
// In-process checks over a process group of one rank (collectives that leave
// tensors as they are) cover the guard's side: parameters without
// gradients, two backward passes, errors.
#include "test_util.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdio>

namespace amp::testing {
namespace {

struct RankRun {
  std::vector<at::Tensor> steps;  // flattened parameters after each step
  int64_t skipped = 0;
  double scale = 0;
};

// Starts ranks 0..world-1 of dist_helper with `args`; every rank must exit 0.
std::vector<RankRun> run_ranks(int world, const std::string& args) {
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
  std::vector<RankRun> ranks(world);
  for (int rank = 0; rank < world; ++rank) {
    const std::string out = dir + "amp_dist_out_" + id + "_" + std::to_string(rank);
    std::vector<at::Tensor> trace;
    torch::load(trace, out);
    std::remove(out.c_str());
    EXPECT_EQ(trace.size(), 7u);
    ranks[rank].steps.assign(trace.begin(), trace.begin() + 5);
    ranks[rank].skipped = trace[5].item<int64_t>();
    ranks[rank].scale = trace[6].item<double>();
  }
  std::remove(store.c_str());
  return ranks;
}

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
double one_process_error(const std::string& level) {
  const RankRun single = run_ranks(1, "level=" + level + " reduce=none")[0];
  const std::vector<at::Tensor> reference = float64_reference();
  double error = 0;
  for (int step = 0; step < 5; ++step) {
    error = std::max(error, (single.steps[step].to(torch::kDouble) - reference[step]).abs().max().item<double>());
  }
  return error;
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

TEST_F(AmpTest, DataParallelWorldSizeOneIsOneProcessBitForBit) {
  for (const std::string level : {"O1", "O2"}) {
    const auto single = run_ranks(1, "level=" + level + " optimizer=adam reduce=none")[0];
    const auto parallel = run_ranks(1, "level=" + level + " optimizer=adam")[0];
    for (int step = 0; step < 5; ++step) {
      EXPECT_TRUE(BitEqual(parallel.steps[step], single.steps[step])) << level << " step " << step;
    }
    EXPECT_EQ(parallel.skipped, single.skipped);
  }
}

TEST_F(AmpTest, DataParallelBucketSizeChangesNoBit) {
  const auto one_bucket = run_ranks(3, "bucket_bytes=1000000"), per_parameter = run_ranks(3, "bucket_bytes=1");
  for (int step = 0; step < 5; ++step) {
    EXPECT_TRUE(BitEqual(one_bucket[0].steps[step], per_parameter[0].steps[step])) << "step " << step;
  }
}

TEST_F(AmpTest, DataParallelAccumulationAveragesTheWholeSum) {
  // Two micro-batches per rank, the first with delay_unscale (no reduction).
  expect_trained_together(run_ranks(3, "micro_batches=2"), 3 * one_process_error("O2"));
}

TEST_F(AmpTest, DataParallelReducesInLowPrecision) {
  // O2 computes in bfloat16 on the CPU; bfloat16 traffic adds one rounding
  // of each rank's mean gradient and of their sum (2^-8 relative each).
  expect_trained_together(run_ranks(4, "reduce_dtype=bfloat16"), 3 * one_process_error("O2") + 2e-3);
}

TEST_F(AmpTest, DataParallelStartsFromRankZerosWeights) {
  // Rank 1 builds its model from another seed; initialize replaces it.
  const auto differently_seeded = run_ranks(2, "seed_per_rank=1");
  const auto ranks = run_ranks(2, "seed_per_rank=0");
  for (int step = 0; step < 5; ++step) {
    EXPECT_TRUE(BitEqual(differently_seeded[1].steps[step], ranks[1].steps[step])) << "step " << step;
  }
}

TEST_F(AmpTest, WithoutAveragingRanksWouldDrift) {
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

// ---- In one process: a process group of one rank ----------------------------

struct DoneWork : c10d::Work {
  bool wait(std::chrono::milliseconds) override { return true; }
};

// A world of one: a broadcast or a sum over one rank leaves the tensors. It
// counts the all-reduces started.
struct WorldOfOne : c10d::Backend {
  WorldOfOne() : c10d::Backend(0, 1) {}
  const std::string getBackendName() const override { return "world_of_one"; }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>&, const c10d::BroadcastOptions&) override {
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    ++allreduces;
    return c10::make_intrusive<DoneWork>();
  }
  std::atomic<int> allreduces{0};
};

Options fake_data_parallel(Options options, c10::intrusive_ptr<WorldOfOne> group = c10::make_intrusive<WorldOfOne>()) {
  options.verbosity = 0;
  options.data_parallel.group = group;
  options.data_parallel.bucket_bytes = 64;
  return options;
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
  auto refused = [&](Options options) {
    try {
      amp::initialize(model, optimizer, options);
    } catch (const c10::Error& e) {
      EXPECT_FALSE(amp::is_initialized());
      return std::string(e.what_without_backtrace());
    }
    return std::string("initialized");
  };
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

}  // namespace
}  // namespace amp::testing
