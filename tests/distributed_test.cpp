// Two processes, data-parallel over ProcessGroupGloo on loopback, at O1 and
// O2: an overflow on rank 1 alone makes both ranks skip; the replicas stay
// bit-identical after every step and match a single-process fp32 reference
// on the concatenated batch; with gradients averaged inside the guard and
// after it.
#include "test_util.h"

#include <cstdio>

namespace amp::testing {
namespace {

// (opt level, where gradients are averaged: "inside" or "after" the guard)
class DistributedTest : public AmpTest,
                        public ::testing::WithParamInterface<std::tuple<OptLevel, const char*>> {};

TEST_P(DistributedTest, EveryRankSkipsTogetherAndReplicasStayIdentical) {
  const std::string level = to_string(std::get<0>(GetParam())), where = std::get<1>(GetParam());
  const std::string run = level + "_" + where, dir = ::testing::TempDir();
  const std::string store = dir + "amp_dist_store_" + run, out0 = dir + "amp_dist_rank0_" + run,
                    out1 = dir + "amp_dist_rank1_" + run;
  std::remove(store.c_str());
  const std::string helper = AMP_DIST_HELPER;
  const std::string args = " 2 " + store + " " + level + " " + where + " ";
  const std::string command = "sh -c '" + helper + " 1" + args + out1 + " & " + helper + " 0" + args + out0 +
                              "; r0=$?; wait $!; r1=$?; exit $((r0 + r1))'";
  ASSERT_EQ(std::system(command.c_str()), 0);
  std::vector<at::Tensor> rank0, rank1;
  torch::load(rank0, out0);
  torch::load(rank1, out1);
  ASSERT_EQ(rank0.size(), 7u);
  for (size_t i = 0; i < rank0.size(); ++i) EXPECT_TRUE(BitEqual(rank0[i], rank1[i])) << "entry " << i;
  EXPECT_EQ(rank0[5].item<int64_t>(), 1);  // skipped steps, on both ranks
  EXPECT_TRUE(BitEqual(rank0[2], rank0[1]));  // step 2 changed nothing
  EXPECT_EQ(rank0[6].item<double>(), 32768.0);

  // Single process, plain fp32, full batch, step 2 skipped.
  torch::manual_seed(3);
  torch::nn::Sequential reference(torch::nn::Linear(6, 16), torch::nn::ReLU(), torch::nn::Linear(16, 2));
  torch::optim::SGD sgd(reference->parameters(), 0.05);
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(100 + step);
    const auto x = torch::randn({16, 6}), y = torch::randn({16, 2});
    sgd.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    if (step != 2) sgd.step();
    std::vector<at::Tensor> parts;
    for (const auto& p : reference->parameters()) parts.push_back(p.detach().flatten());
    EXPECT_TRUE(torch::allclose(rank0[step], torch::cat(parts), 1e-2, 1e-2)) << "step " << step;
  }
  for (const auto& f : {store, out0, out1}) std::remove(f.c_str());
}

INSTANTIATE_TEST_SUITE_P(LevelsAndPlacements, DistributedTest,
                         ::testing::Combine(::testing::Values(O1, O2), ::testing::Values("inside", "after")),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) + "_grads_reduced_" +
                                  std::get<1>(info.param) + "_guard";
                         });

}  // namespace
}  // namespace amp::testing
