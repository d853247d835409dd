// Save mid-training at O0-O3, resume in a fresh process, continue: the result
// equals the uninterrupted run bit for bit. A corrupted file is refused.
#include "test_util.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace amp::testing {
namespace {

// std::filesystem::remove_all binds to a copy exported by libtorch.so that
// crashes; plain remove() of the few files is enough.
void remove_files(const std::vector<std::string>& paths) {
  for (const auto& p : paths) std::remove(p.c_str());
}

int run_helper(const std::string& args) {
  return std::system((std::string(AMP_RESUME_HELPER) + " " + args).c_str());
}

class FreshProcessResumeTest : public AmpTest, public ::testing::WithParamInterface<OptLevel> {};

TEST_P(FreshProcessResumeTest, ResumedRunIsBitIdenticalToTheUninterruptedOne) {
  const std::string level = to_string(GetParam());
  const auto dir = std::filesystem::temp_directory_path() / ("amp_resume_" + level);
  std::filesystem::create_directories(dir);
  const std::string checkpoint = (dir / "checkpoint.pt").string(), full = (dir / "full.pt").string(),
                    resumed = (dir / "resumed.pt").string();
  ASSERT_EQ(run_helper(level + " full " + full), 0);
  ASSERT_EQ(run_helper(level + " save " + checkpoint), 0);
  ASSERT_EQ(run_helper(level + " resume " + checkpoint + " " + resumed), 0);
  std::vector<at::Tensor> a, b;
  torch::load(a, full);
  torch::load(b, resumed);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(BitEqual(a[i], b[i])) << level << " tensor " << i;
  remove_files({checkpoint, full, resumed});
}

INSTANTIATE_TEST_SUITE_P(Levels, FreshProcessResumeTest, ::testing::Values(O0, O1, O2, O3),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST_F(FreshProcessResumeTest, CorruptedCheckpointIsRefusedAndChangesNothing) {
  // One directory per process: parallel test runs must not collide.
  const auto dir = std::filesystem::temp_directory_path() / ("amp_corrupt_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string checkpoint = (dir / "checkpoint.pt").string();
  ASSERT_EQ(run_helper("O2 save " + checkpoint), 0);
  {  // flip bytes in the middle of the file
    std::fstream file(checkpoint, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(std::filesystem::file_size(checkpoint) / 2));
    const std::string garbage(64, '\x5a');
    file.write(garbage.data(), static_cast<std::streamsize>(garbage.size()));
  }
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-2);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O2));
  std::vector<at::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
  const LossScaler::State scaler_before = loss_scaler().state();
  EXPECT_THROW(load_checkpoint(checkpoint, {model.ptr()}, {optimizer}), c10::Error);
  const auto after = model->parameters();
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(BitEqual(after[i], before[i])) << "parameter " << i;
  EXPECT_TRUE(BitEqual(loss_scaler().state().scale, scaler_before.scale));
  EXPECT_TRUE(BitEqual(loss_scaler().state().growth_tracker, scaler_before.growth_tracker));
  remove_files({checkpoint});
}

}  // namespace
}  // namespace amp::testing
