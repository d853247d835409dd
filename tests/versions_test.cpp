// SPDX-License-Identifier: BSD-3-Clause
// Versions: amp's own (the header's macros, amp::version(), the CMake
// project's), the LibTorch it runs against (the one it was compiled
// against, checked at initialize), and the format of the state and
// checkpoints it saves - files written by amp 0.1 (format 1, kept in
// tests/data/format1, written by the fuzzer's set-up) load, and a newer
// format is refused before anything changes.
#include "test_util.h"

#include "persistence/state_format.h"
#include "support/versions.h"
#include "fuzz/fuzz_net.h"

#include <ATen/Version.h>
#include <torch/headeronly/version.h>

namespace amp::testing {
namespace {

TEST(VersionTest, TheLibraryTheHeadersAndTheProjectSayTheSameVersion) {
  EXPECT_STREQ(amp::version(), AMP_VERSION_STRING);
  EXPECT_STREQ(AMP_VERSION_STRING, AMP_PROJECT_VERSION);  // CMake's project(amp VERSION ...)
  EXPECT_EQ(c10::str(AMP_VERSION_MAJOR, ".", AMP_VERSION_MINOR, ".", AMP_VERSION_PATCH), AMP_VERSION_STRING);
  EXPECT_EQ(AMP_VERSION, AMP_VERSION_MAJOR * 10000 + AMP_VERSION_MINOR * 100 + AMP_VERSION_PATCH);
}

TEST(VersionTest, TheLinkedLibTorchIsTheOneAmpWasCompiledAgainst) {
  const std::string running = detail::torch_version_in(at::show_config());
  EXPECT_EQ(running.rfind(c10::str(TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, "."), 0), 0u) << running;
  EXPECT_NO_THROW(detail::require_linked_torch());
}

TEST(VersionTest, LibTorchsVersionIsReadFromItsBuildConfiguration) {
  EXPECT_EQ(detail::torch_version_in("  - Build settings: BLAS_INFO=mkl, TORCH_VERSION=2.11.0, USE_CUDA=ON"), "2.11.0");
  EXPECT_EQ(detail::torch_version_in("TORCH_VERSION=2.12.0a0+git1234abc, USE_MPI=OFF"), "2.12.0a0+git1234abc");
  EXPECT_EQ(detail::torch_version_in("Build settings: USE_CUDA=ON"), "");
}

TEST(VersionTest, AnotherMinorVersionOfLibTorchIsRefusedSayingHowToFixIt) {
  EXPECT_NO_THROW(detail::require_torch_version("2.11.0", "2.11.0"));
  EXPECT_NO_THROW(detail::require_torch_version("2.11.0", "2.11.3"));  // patch releases keep the ABI
  EXPECT_AMP_ERROR(detail::require_torch_version("2.11.0", "2.12.0"),
                   "compiled against LibTorch 2.11.0 but runs against LibTorch 2.12.0");
  EXPECT_AMP_ERROR(detail::require_torch_version("2.11.0", "2.1.1"), "rebuild amp and the program");
  EXPECT_AMP_ERROR(detail::require_torch_version("2.11.0", "3.11.0"), "runs against LibTorch 3.11.0");
  EXPECT_AMP_ERROR(detail::require_torch_version("2.11.0", ""), "LibTorch of unknown version");
}

// The set-up that wrote tests/data/format1 (tests/fuzz/fuzz_loaders.cpp):
// O2, Adam, two loss scalers.
using fuzz::FuzzNet;

class StateFormatTest : public AmpTest {
 protected:
  void SetUp() override {
    torch::manual_seed(1);
    optimizer_ = std::make_shared<torch::optim::Adam>(model_->parameters(), 1e-2);
    Options options = quiet(O2);
    options.num_losses = 2;
    std::tie(model_, optimizer_) = handle_.initialize(model_, optimizer_, options);
  }
  void TearDown() override {
    handle_.deinitialize();
    AmpTest::TearDown();
  }
  static std::string format1(const std::string& name) { return std::string(AMP_TEST_DATA) + "/format1/" + name; }
  // The scale and growth tracker saved for `loss_id`.
  static std::pair<double, int64_t> saved_scaler(torch::serialize::InputArchive& state, int loss_id) {
    torch::serialize::InputArchive scaler;
    EXPECT_TRUE(state.try_read("loss_scaler" + std::to_string(loss_id), scaler));
    at::Tensor scale, tracker;
    EXPECT_TRUE(scaler.try_read("scale", scale) && scaler.try_read("growth_tracker", tracker));
    return {scale.item<double>(), tracker.item<int64_t>()};
  }
  static std::pair<double, int64_t> live_scaler(int loss_id) {
    return {loss_scale(loss_id), amp::loss_scaler(loss_id)->growth_tracker()};
  }

  Handle handle_;
  FuzzNet model_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
};

TEST_F(StateFormatTest, StateSavedByAmp01Loads) {
  torch::serialize::InputArchive file;
  file.load_from(format1("state.pt"));
  at::Tensor format;
  ASSERT_FALSE(file.try_read(detail::kStateFormatEntry, format)) << "format 1 has no version entry";
  ASSERT_EQ(live_scaler(0).second, 0);  // fresh; the file's scalers had stepped
  load_state(file);
  for (int loss_id : {0, 1}) {
    EXPECT_EQ(live_scaler(loss_id), saved_scaler(file, loss_id)) << loss_id;
    EXPECT_GT(live_scaler(loss_id).second, 0) << loss_id;
  }
}

TEST_F(StateFormatTest, CheckpointSavedByAmp01Loads) {
  torch::serialize::InputArchive file, model, amp_state;
  file.load_from(format1("checkpoint.pt"));
  ASSERT_TRUE(file.try_read("model0", model));
  ASSERT_TRUE(file.try_read("amp", amp_state));
  load_checkpoint(format1("checkpoint.pt"), {model_.ptr()}, {optimizer_});
  // Every weight and buffer holds the file's float32 value (O2: the masters' values).
  for (const auto& [name, tensor] : {std::pair<std::string, at::Tensor>{"a.weight", model_->a->weight},
                                     {"b.bias", model_->b->bias}, {"bn.running_mean", model_->bn->running_mean}}) {
    torch::serialize::InputArchive nested;
    at::Tensor saved;
    const auto dot = name.find('.');
    ASSERT_TRUE(model.try_read(name.substr(0, dot), nested)) << name;
    ASSERT_TRUE(nested.try_read(name.substr(dot + 1), saved, name.find("running") != std::string::npos)) << name;
    const std::vector<at::Tensor> masters = amp::master_params(*optimizer_);
    const at::Tensor live = name == "a.weight" ? masters[0] : name == "b.bias" ? masters[5] : tensor;
    EXPECT_TRUE(BitEqual(live.to(at::kFloat), saved)) << name;
  }
  EXPECT_EQ(live_scaler(1), saved_scaler(amp_state, 1));
  // Adam's step counts came back too: the file was written after three steps.
  const auto& state = optimizer_->state();
  ASSERT_FALSE(state.empty());
  for (const auto& [key, value] : state) {
    EXPECT_EQ(static_cast<const torch::optim::AdamParamState&>(*value).step(), 3) << key;
  }
}

TEST_F(StateFormatTest, StateAndCheckpointsCarryTheFormatTheyAreWrittenIn) {
  torch::serialize::OutputArchive out;
  save_state(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in(bytes.str());
  torch::serialize::InputArchive state;
  state.load_from(in);
  EXPECT_EQ(detail::read_state_format(state, "state"), detail::kStateFormat);
  EXPECT_NO_THROW(load_state(state));

  const std::string path = temp_path("format.ckpt");
  save_checkpoint(path, {model_.ptr()}, {optimizer_});
  torch::serialize::InputArchive checkpoint;
  checkpoint.load_from(path);
  EXPECT_EQ(detail::read_state_format(checkpoint, "checkpoint"), detail::kStateFormat);
  EXPECT_NO_THROW(load_checkpoint(path, {model_.ptr()}, {optimizer_}));
  std::remove(path.c_str());
}

TEST_F(StateFormatTest, ANewerFormatIsRefusedBeforeAnythingChanges) {
  const int64_t newer = detail::kStateFormat + 1;
  torch::serialize::OutputArchive state;
  state.write(detail::kStateFormatEntry, at::scalar_tensor(newer, at::kLong));
  state.write("opt_level", c10::IValue(std::string("O2")));
  state.write("num_losses", at::scalar_tensor(int64_t{2}, at::kLong));
  std::ostringstream bytes;
  state.save_to(bytes);
  const auto scaler_before = live_scaler(0);
  EXPECT_AMP_ERROR(load_state_bytes(bytes.str()),
                   "the state was written by a newer amp, in format " + std::to_string(newer));
  EXPECT_AMP_ERROR(load_state_bytes(bytes.str()), "reads formats 1 to " + std::to_string(detail::kStateFormat));
  EXPECT_EQ(live_scaler(0), scaler_before);

  // A checkpoint: refused before its model entries are read.
  const std::string path = temp_path("newer.ckpt");
  torch::serialize::OutputArchive checkpoint;
  checkpoint.write(detail::kStateFormatEntry, at::scalar_tensor(newer, at::kLong));
  checkpoint.save_to(path);
  const std::vector<at::Tensor> before = clones(model_->parameters());
  EXPECT_AMP_ERROR(load_checkpoint(path, {model_.ptr()}, {optimizer_}),
                   "checkpoint '" + path + "' was written by a newer amp");
  EXPECT_TRUE(AllBitEqual(model_->parameters(), before));
  EXPECT_EQ(live_scaler(0), scaler_before);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace amp::testing
