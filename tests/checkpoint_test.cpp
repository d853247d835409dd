// Loading untrusted state is all-or-nothing and refuses values that cannot
// train: loss scales that are not finite and positive, optimizer state that
// does not fit its parameters, and checkpoints whose later parts are bad
// after earlier parts loaded. (The fuzzer in tests/fuzz runs thousands of
// mutated files through the same loaders.)
#include "test_util.h"

#include <filesystem>
#include <functional>
#include <limits>

#include <unistd.h>

namespace amp::testing {
namespace {

class CheckpointTest : public AmpTest {
 protected:
  // The fixture's handle ends its initialization before AmpTest drops registrations.
  void TearDown() override {
    handle_.deinitialize();
    AmpTest::TearDown();
  }
  void SetUp() override {
    torch::manual_seed(3);
    a_ = torch::nn::Linear(4, 6);
    b_ = torch::nn::Linear(6, 4);
    OptimizerPtr oa = std::make_shared<torch::optim::Adam>(a_->parameters(), 1e-2);
    OptimizerPtr ob = std::make_shared<torch::optim::Adam>(b_->parameters(), 1e-2);
    handle_.initialize({a_, b_}, {oa, ob}, quiet(O1));
    optimizers_ = {oa, ob};
    step(0);
  }
  void step(int i) {
    torch::manual_seed(10 + i);
    for (auto& o : optimizers_) o->zero_grad();
    {
      scale_loss scaled(b_(torch::tanh(a_(torch::randn({5, 4})))).pow(2).mean(), optimizers_);
      scaled.backward();
    }
    for (auto& o : optimizers_) o->step();
  }
  std::vector<at::Tensor> everything() const {
    std::vector<at::Tensor> out;
    for (const auto& p : a_->parameters()) out.push_back(p.detach().clone());
    for (const auto& p : b_->parameters()) out.push_back(p.detach().clone());
    for (const auto& o : optimizers_) {
      for (const auto& t : optimizer_state_tensors(*o)) out.push_back(t.clone());
    }
    out.push_back(loss_scaler().state().scale.clone());
    out.push_back(loss_scaler().state().growth_tracker.clone());
    return out;
  }
  static void expect_same(const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& y) {
    ASSERT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(BitEqual(x[i], y[i])) << "tensor " << i;
  }
  std::string path(const std::string& name) const {
    return (std::filesystem::temp_directory_path() / ("amp_checkpoint_test_" + std::to_string(getpid()) + name)).string();
  }

  Handle handle_;
  torch::nn::Linear a_{nullptr}, b_{nullptr};
  std::vector<OptimizerPtr> optimizers_;
};

// Writes a file in save_checkpoint's layout from parts a test chooses: how
// each model entry is written, and whose state each optimizer entry holds.
using ModuleWriter = std::function<void(torch::serialize::OutputArchive&)>;
void write_checkpoint(const std::string& file, const std::vector<ModuleWriter>& models,
                      const std::vector<OptimizerPtr>& optimizers) {
  torch::serialize::OutputArchive archive;
  for (size_t i = 0; i < models.size(); ++i) {
    torch::serialize::OutputArchive model(archive.compilation_unit());
    models[i](model);
    archive.write("model" + std::to_string(i), model);
  }
  for (size_t i = 0; i < optimizers.size(); ++i) {
    torch::serialize::OutputArchive optimizer(archive.compilation_unit());
    optimizers[i]->save(optimizer);
    archive.write("optimizer" + std::to_string(i), optimizer);
  }
  torch::serialize::OutputArchive state(archive.compilation_unit());
  save_state(state);
  archive.write("amp", state);
  archive.save_to(file);
}

std::string state_with_scaler(float scale, int growth) {
  torch::serialize::OutputArchive archive;
  archive.write("opt_level", c10::IValue(std::string("O1")));
  archive.write("num_losses", at::scalar_tensor(int64_t{1}, at::kLong));
  torch::serialize::OutputArchive scaler(archive.compilation_unit());
  scaler.write("scale", at::full({1}, scale, at::kFloat));
  scaler.write("growth_tracker", at::full({1}, growth, at::kInt));
  scaler.write("hysteresis_tracker", at::full({1}, 1, at::kInt));
  scaler.write("dynamic", at::scalar_tensor(1, at::kInt));
  archive.write("loss_scaler0", scaler);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

TEST_F(CheckpointTest, LoadStateRefusesScalesThatAreNotFiniteAndPositiveAndNegativeTrackers) {
  const auto before = everything();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), 0.0f, -2.0f}) {
    EXPECT_AMP_ERROR(load_state_bytes(state_with_scaler(bad, 0)), "must be finite and positive");
  }
  EXPECT_AMP_ERROR(load_state_bytes(state_with_scaler(128, -1)), "cannot be negative");
  expect_same(before, everything());
  load_state_bytes(state_with_scaler(128, 3));  // a sane state still loads
  EXPECT_EQ(loss_scale(), 128.0);
  EXPECT_EQ(loss_scaler().growth_tracker(), 3);
}

TEST_F(CheckpointTest, OptimizerStateOfOtherShapesIsRefusedAndChangesNothing) {
  // b's Adam state in a's entry: the same number of tensors, transposed
  // shapes. LibTorch's own load accepts it and the next step would fail.
  const std::string file = path("_other_shapes.pt");
  write_checkpoint(file, {[&](auto& a) { a_->save(a); }, [&](auto& a) { b_->save(a); }},
                   {optimizers_[1], optimizers_[1]});
  step(1);
  const auto before = everything();
  EXPECT_AMP_ERROR(load_checkpoint(file, std::vector<ModulePtr>{a_.ptr(), b_.ptr()}, optimizers_),
                   "exp_avg' of parameter 0 is Float[4, 6]");
  expect_same(before, everything());
  step(2);  // still trains
  std::remove(file.c_str());
}

TEST_F(CheckpointTest, OptimizerOptionsThatFloat32CannotHoldAreRefused) {
  auto& options = static_cast<torch::optim::AdamOptions&>(optimizers_[0]->param_groups()[0].options());
  options.lr(1e300);  // saved like this, a step would fail converting it
  const std::string file = path("_huge_lr.pt");
  save_checkpoint(file, std::vector<ModulePtr>{a_.ptr(), b_.ptr()}, optimizers_);
  options.lr(1e-2);
  step(1);
  const auto before = everything();
  EXPECT_AMP_ERROR(load_checkpoint(file, std::vector<ModulePtr>{a_.ptr(), b_.ptr()}, optimizers_),
                   "has lr=1e+300, which is not a finite float32 value");
  expect_same(before, everything());
  EXPECT_EQ(optimizers_[0]->param_groups()[0].options().get_lr(), 1e-2);
  std::remove(file.c_str());
}

TEST_F(CheckpointTest, CheckpointWhoseSecondOptimizerIsBadLoadsNothing) {
  // A file whose "optimizer1" holds optimizer 0's state.
  const std::string file = path("_bad_second.pt");
  write_checkpoint(file, {[&](auto& a) { a_->save(a); }, [&](auto& a) { b_->save(a); }},
                   {optimizers_[0], optimizers_[0]});
  step(1);  // everything moves on from the file's values, the scaler too
  loss_scaler().update(torch::ones({1}));
  const auto before = everything();
  EXPECT_AMP_ERROR(load_checkpoint(file, std::vector<ModulePtr>{a_.ptr(), b_.ptr()}, optimizers_), "cannot load the optimizer's state");
  expect_same(before, everything());
  std::remove(file.c_str());
}

TEST_F(CheckpointTest, CheckpointEntryOfAnotherKindOfDtypeIsRefused) {
  const std::string file = path("_int_weights.pt");
  const std::string good = path("_good.pt");
  save_checkpoint(good, std::vector<ModulePtr>{a_.ptr(), b_.ptr()}, optimizers_);
  write_checkpoint(file,  // the same file with model0's weight as integers
                   {[&](auto& a) {
                      a.write("weight", a_->weight.detach().to(at::kInt));
                      a.write("bias", a_->bias.detach());
                    },
                    [&](auto& a) { b_->save(a); }},
                   optimizers_);
  step(1);
  const auto before = everything();
  EXPECT_AMP_ERROR(load_checkpoint(file, std::vector<ModulePtr>{a_.ptr(), b_.ptr()}, optimizers_), "'weight' holds Int values");
  expect_same(before, everything());
  load_checkpoint(good, std::vector<ModulePtr>{a_.ptr(), b_.ptr()}, optimizers_);  // the intact file loads
  std::remove(file.c_str());
  std::remove(good.c_str());
}

}  // namespace
}  // namespace amp::testing
