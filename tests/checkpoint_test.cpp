// SPDX-License-Identifier: BSD-3-Clause
// Saving and restoring: amp's state (loss scalers, level), checkpoints
// written by amp::save_checkpoint, resuming in a fresh process, and loading
// untrusted files all-or-nothing - refusing values that cannot train (loss
// scales that are not finite and positive, optimizer state that does not fit
// its parameters, later parts bad after earlier parts loaded) and damaged
// files. The program's own torch::save / torch::load is in adoption_test.cpp;
// fused optimizers' checkpoints in fused_optimizers_test.cpp; the fuzzer in
// tests/fuzz runs thousands of mutated files through the same loaders.
#include "test_util.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

extern char** environ;

namespace amp::testing {
namespace {


std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

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
    out.push_back(internal::live_scaling().state().scale.clone());
    out.push_back(internal::live_scaling().state().growth_tracker.clone());
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
  EXPECT_EQ(loss_scaler()->growth_tracker(), 3);
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
  internal::live_scaling().update(overflowed_verdict());
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

// A checkpoint cut short or with bytes overwritten is refused with the
// reason, and nothing in the running program changes.
TEST_F(CheckpointTest, DamagedFileIsRefusedAndChangesNothing) {
  const std::string file = path("damaged.pt");
  save_checkpoint(file, {a_.ptr(), b_.ptr()}, optimizers_);
  const std::string good = read_file(file);
  step(1);  // the program moves on from what the file holds
  const auto before = everything();
  auto overwrite_middle = [&] {
    std::fstream out(file, std::ios::in | std::ios::out | std::ios::binary);
    out.seekp(static_cast<std::streamoff>(good.size() / 2));
    const std::string garbage(64, '\x5a');
    out.write(garbage.data(), static_cast<std::streamsize>(garbage.size()));
  };
  auto cut_in_half = [&] { std::filesystem::resize_file(file, good.size() / 2); };
  for (const auto& damage : {std::function<void()>(overwrite_middle), std::function<void()>(cut_in_half)}) {
    write_file(file, good);
    damage();
    EXPECT_AMP_ERROR(load_checkpoint(file, {a_.ptr(), b_.ptr()}, optimizers_), "truncated or corrupt");
    expect_same(everything(), before);
  }
  write_file(file, good);  // the undamaged file loads: the refusals were the damage's
  load_checkpoint(file, {a_.ptr(), b_.ptr()}, optimizers_);
  EXPECT_FALSE(BitEqual(a_->weight, before[0]));
  std::remove(file.c_str());
}

// ---- amp's own state: loss scalers and the level ------------------------------

class AmpStateTest : public AmpTest {};


TEST_F(AmpStateTest, AmpStateRoundTripsEveryScaler) {
  auto model = torch::nn::Linear(2, 1);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Options options = quiet(O1);
  options.num_losses = 2;
  options.dynamic_scaling.hysteresis = 3;
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  {
    scale_loss scaled(model(torch::randn({2, 2})).sum(), optimizer, {1});
    scaled.backward();
    model->bias.grad()[0] = kInf;
  }
  optimizer->step();
  torch::serialize::OutputArchive out;
  save_state(out);
  std::stringstream bytes;
  out.save_to(bytes);
  const double scale1 = loss_scale(1);
  const int64_t hysteresis1 = loss_scaler(1)->hysteresis_tracker();
  EXPECT_EQ(hysteresis1, 2);
  handle.deinitialize();

  auto fresh = torch::nn::Linear(2, 1);
  OptimizerPtr fresh_optimizer = std::make_shared<torch::optim::SGD>(fresh->parameters(), 0.1);
  std::tie(fresh, fresh_optimizer) = handle.initialize(fresh, fresh_optimizer, options);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  load_state(in);
  EXPECT_EQ(loss_scale(1), scale1);
  EXPECT_EQ(loss_scaler(1)->hysteresis_tracker(), hysteresis1);
  EXPECT_EQ(loss_scale(0), 65536.0);
}

// An amp state archive with `level` stored as given (a name or, as
// checkpoints written before names were, the enum's number).
std::string state_bytes(const c10::IValue& level) {
  torch::serialize::OutputArchive out;
  out.write("opt_level", level);
  out.write("num_losses", at::scalar_tensor(int64_t{1}, at::kLong));
  torch::serialize::OutputArchive scaler(out.compilation_unit());
  loss_scaler(0)->save(scaler);
  out.write("loss_scaler0", scaler);
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
}

TEST_F(AmpStateTest, StateNamesItsLevelAndStillReadsNumberedCheckpoints) {
  auto model = torch::nn::Linear(2, 1);
  Handle handle;
  model = handle.initialize(model, quiet(O2));
  torch::serialize::OutputArchive out;
  save_state(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  c10::IValue saved;
  ASSERT_TRUE(in.try_read("opt_level", saved));
  EXPECT_EQ(saved.toStringRef(), "O2");

  load_state_bytes(state_bytes(at::scalar_tensor(int64_t{2}, at::kLong)));  // O2, numbered
  EXPECT_AMP_ERROR(load_state_bytes(state_bytes(at::scalar_tensor(int64_t{1}, at::kLong))),
                   "saved at opt_level O1 but amp runs at O2");
  EXPECT_AMP_ERROR(load_state_bytes(state_bytes(at::scalar_tensor(int64_t{9}, at::kLong))),
                   "holds 9, which names no opt level");
  EXPECT_AMP_ERROR(load_state_bytes(state_bytes(c10::IValue(std::string("O9")))),
                   "unexpected optimization level 'O9'");
}

TEST_F(AmpStateTest, LoadingStateIntoADifferentSetupIsAnErrorAndChangesNothing) {
  Options two = quiet(O1);
  two.num_losses = 2;
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, two);
  torch::serialize::OutputArchive out;
  save_state(out);
  std::stringstream bytes;
  out.save_to(bytes);
  handle.deinitialize();

  // Scalers moved away from their initial values, to see that nothing is loaded.
  auto expect_scalers_unchanged = [](int num_losses, auto&& load) {
    std::vector<internal::LossScaling::State> before;
    for (int i = 0; i < num_losses; ++i) before.push_back(internal::live_scaling(i).state());
    load();
    for (int i = 0; i < num_losses; ++i) {
      EXPECT_TRUE(BitEqual(internal::live_scaling(i).state().scale, before[i].scale)) << "loss " << i;
      EXPECT_TRUE(BitEqual(internal::live_scaling(i).state().growth_tracker, before[i].growth_tracker)) << "loss " << i;
    }
  };
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  internal::live_scaling(0).update(overflowed_verdict(0));  // an overflow
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  expect_scalers_unchanged(1, [&] { EXPECT_AMP_ERROR(load_state(in), "num_losses=1"); });
  handle.deinitialize();
  Options o2 = quiet(O2);
  o2.num_losses = 2;
  handle.initialize(std::vector<ModulePtr>{}, {}, o2);
  internal::live_scaling(1).update(overflowed_verdict(1));  // an overflow
  bytes.seekg(0);
  torch::serialize::InputArchive again;
  again.load_from(bytes);
  expect_scalers_unchanged(2, [&] { EXPECT_AMP_ERROR(load_state(again), "opt_level O1"); });
  torch::serialize::InputArchive empty;
  expect_scalers_unchanged(2, [&] { EXPECT_AMP_ERROR(load_state(empty), "'opt_level'"); });
  EXPECT_EQ(loss_scale(1), 32768.0);
}

// ---- What a checkpoint holds ---------------------------------------------------

// At O2 a checkpoint's weights are the float32 masters: a plain float32
// model loads them without amp.
TEST_F(AmpStateTest, O2CheckpointHoldsFloat32WeightsThatLoadIntoAPlainModel) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O2));
  optimizer->zero_grad();
  {
    scale_loss scaled(model(torch::randn({4, 8})).pow(2).mean(), optimizer);
    scaled.backward();
  }
  optimizer->step();
  const std::string path = temp_path("fp32_weights.pt");
  save_checkpoint(path, {model.ptr()}, {optimizer});
  TinyNet fp32;
  torch::serialize::InputArchive file, weights;
  file.load_from(path);
  ASSERT_TRUE(file.try_read("model0", weights));
  fp32->load(weights);
  EXPECT_EQ(fp32->fc1->weight.scalar_type(), at::kFloat);
  EXPECT_TRUE(BitEqual(fp32->fc1->weight, model->fc1->weight));  // the master, at rest
  std::remove(path.c_str());
}

// ---- Resuming in a fresh process ---------------------------------------------

// Save mid-training at each level, resume in a process of its own (which
// starts from nothing but the file), continue: the result equals the
// uninterrupted run bit for bit, the overflow before the save included.
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

// A process killed while it writes a checkpoint leaves the one before (or
// none), never a torn file: the writer is SIGKILLed at several moments of a
// loop that rewrites a 48 MB checkpoint, and the file loads every time.
// The first kills come at fixed times from its start, perhaps before its
// first checkpoint; the others at offsets after this writer's first one is
// complete, however long a loaded machine takes to start it.
TEST_F(CheckpointTest, AWriterKilledMidWriteLeavesTheLastCompleteCheckpoint) {
  const std::string path = temp_path("killed_writer.pt");
  std::remove(path.c_str());
  torch::manual_seed(1);
  torch::nn::Linear big(2048, 2048);
  torch::optim::Adam adam(big->parameters(), 1e-3);
  handle_.deinitialize();  // the fixture's models are not this test's
  handle_.initialize(big, adam, quiet(O2));
  auto kill_writer = [&](int delay_ms, bool after_first_checkpoint) {
    const std::string helper = AMP_RESUME_HELPER;
    std::vector<std::string> args = {helper, "O2", "save_forever", path};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (after_first_checkpoint) std::remove(path.c_str());
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, helper.c_str(), nullptr, nullptr, argv.data(), environ), 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
    while (after_first_checkpoint && !std::filesystem::exists(path) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the writer ended before it was killed";
    ASSERT_TRUE(!after_first_checkpoint || std::filesystem::exists(path)) << "the writer wrote no checkpoint in 2 min";
    if (!std::filesystem::exists(path)) return;  // killed before its first checkpoint
    EXPECT_NO_THROW(load_checkpoint(path, {big.ptr()}, {adam}))
        << "killed " << delay_ms << " ms after " << (after_first_checkpoint ? "its first checkpoint" : "its start");
  };
  for (const int delay_ms : {150, 400}) kill_writer(delay_ms, /*after_first_checkpoint=*/false);
  for (const int delay_ms : {0, 40, 120, 250, 400}) kill_writer(delay_ms, /*after_first_checkpoint=*/true);
  std::remove(path.c_str());
  // The killed writers' folders: ".<name>.partial.<pid>/<name>".
  const std::filesystem::path target(path);
  for (const auto& entry : std::filesystem::directory_iterator(target.parent_path())) {
    if (entry.path().filename().string().rfind("." + target.filename().string() + ".partial.", 0) != 0) continue;
    std::remove((entry.path() / target.filename()).c_str());
    std::remove(entry.path().c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, FreshProcessResumeTest, ::testing::Values(O0, O1, O2, O3, O4, O5),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace amp::testing
