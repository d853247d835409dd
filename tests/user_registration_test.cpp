// SPDX-License-Identifier: BSD-3-Clause
// Users register ops by name, in any namespace, as half, float or promote,
// before or after initialize.
#include "test_util.h"

#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace {

// A custom operator in its own namespace, as a user library would define it.
at::Tensor blend(const at::Tensor& a, const at::Tensor& b) { return a * 0.5 + b * 0.5; }

TORCH_LIBRARY(amp_test, m) { m.def("blend(Tensor a, Tensor b) -> Tensor"); }
TORCH_LIBRARY_IMPL(amp_test, CPU, m) { m.impl("blend", &blend); }

at::Tensor call_blend(const at::Tensor& a, const at::Tensor& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("amp_test::blend", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(a, b);
}

}  // namespace

namespace amp::testing {
namespace {

class UserRegistrationTest : public AmpTest {
 protected:
  // The fixture's handle ends its initialization before AmpTest drops registrations.
  void TearDown() override {
    handle.deinitialize();
    AmpTest::TearDown();
  }
  void initialize() { handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1)); }
  Handle handle;
  const at::Tensor a = torch::randn({4}), b = torch::randn({4});
};
// Tests that run amp on several threads (ThreadSanitizer runs every *ThreadsTest).
class UserRegistrationThreadsTest : public UserRegistrationTest {};

TEST_F(UserRegistrationTest, CustomOpRegisteredBeforeInitializeRunsInLowPrecision) {
  register_half_function("amp_test::blend");
  initialize();
  EXPECT_EQ(call_blend(a, b).scalar_type(), at::kBFloat16);
  EXPECT_EQ(policy_for("amp_test::blend", c10::kCPU), CastPolicy::kLowerPrecision);
}

TEST_F(UserRegistrationTest, CustomOpRegisteredAfterInitializeAppliesAtOnce) {
  initialize();
  EXPECT_EQ(call_blend(a.to(at::kBFloat16), b.to(at::kBFloat16)).scalar_type(), at::kBFloat16);
  register_float_function("amp_test::blend");
  EXPECT_EQ(call_blend(a.to(at::kBFloat16), b.to(at::kBFloat16)).scalar_type(), at::kFloat);
  register_promote_function("amp_test::blend");
  EXPECT_EQ(call_blend(a.to(at::kBFloat16), b).scalar_type(), at::kFloat);
  EXPECT_EQ(call_blend(a.to(at::kBFloat16), b.to(at::kBFloat16)).scalar_type(), at::kBFloat16);
}

TEST_F(UserRegistrationTest, BuiltInOpsCanBeMovedBetweenLists) {
  initialize();
  register_float_function("aten::mm");  // typed kernel, policy changed in place
  EXPECT_EQ(torch::mm(a.view({2, 2}), b.view({2, 2})).scalar_type(), at::kFloat);
  register_half_function("aten::relu");  // not in the tables: a new (boxed) kernel
  EXPECT_EQ(torch::relu(a).scalar_type(), at::kBFloat16);
  register_op("aten::softmax.int", CastPolicy::kFp32SetOptDtype, c10::kCPU);
  EXPECT_EQ(torch::softmax(a.to(at::kBFloat16), 0).scalar_type(), at::kFloat);
  EXPECT_EQ(torch::softmax(a.to(at::kBFloat16), 0, at::kBFloat16).scalar_type(), at::kBFloat16);
}

TEST_F(UserRegistrationTest, RegistrationsEndWithDeinitializeButPersistForTheNextOne) {
  register_half_function("aten::relu");
  initialize();
  EXPECT_EQ(torch::relu(a).scalar_type(), at::kBFloat16);
  handle.deinitialize();
  EXPECT_EQ(torch::relu(a).scalar_type(), at::kFloat);
  initialize();
  EXPECT_EQ(torch::relu(a).scalar_type(), at::kBFloat16);
}

// A registration made while another thread initializes amp is either read by
// the new interceptor or applied to it once live; never lost in between.
TEST_F(UserRegistrationThreadsTest, RegistrationsConcurrentWithInitializeAreNeverLost) {
  const std::vector<std::pair<std::string, at::Tensor (*)(const at::Tensor&)>> ops = {
      {"aten::relu", &at::relu},   {"aten::tanh", &at::tanh},   {"aten::sigmoid", &at::sigmoid},
      {"aten::exp", &at::exp},     {"aten::neg", &at::neg},     {"aten::abs", &at::abs},
      {"aten::sin", &at::sin},     {"aten::cos", &at::cos},     {"aten::sqrt", &at::sqrt},
      {"aten::floor", &at::floor}, {"aten::ceil", &at::ceil},   {"aten::trunc", &at::trunc},
      {"aten::frac", &at::frac},   {"aten::sign", &at::sign},   {"aten::erf", &at::erf},
      {"aten::expm1", &at::expm1},
  };
  for (const auto& [name, fn] : ops) ASSERT_EQ(policy_for(name, c10::kCPU), std::nullopt) << name;
  std::atomic<bool> done{false};
  std::thread registrar([&] {
    for (const auto& [name, fn] : ops) {
      std::this_thread::sleep_for(std::chrono::microseconds(300));
      register_half_function(name, c10::kCPU);
    }
    done = true;
  });
  const auto x = torch::rand({4}) + 0.5;
  int rounds = 0;
  while (!done || rounds == 0) {
    initialize();
    for (const auto& [name, fn] : ops) {
      // Registered before this call: the live interceptor must apply it.
      if (policy_for(name, c10::kCPU) == CastPolicy::kLowerPrecision) {
        EXPECT_EQ(fn(x).scalar_type(), at::kBFloat16) << name << " in round " << rounds;
      }
    }
    handle.deinitialize();
    ++rounds;
  }
  registrar.join();
  initialize();
  for (const auto& [name, fn] : ops) EXPECT_EQ(fn(x).scalar_type(), at::kBFloat16) << name;
}

TEST_F(UserRegistrationTest, PerDeviceRegistrationLeavesOtherDevicesAlone) {
  register_float_function("amp_test::blend", c10::kCUDA);
  EXPECT_EQ(policy_for("amp_test::blend", c10::kCUDA), CastPolicy::kFp32);
  EXPECT_EQ(policy_for("amp_test::blend", c10::kCPU), std::nullopt);
}

TEST_F(UserRegistrationTest, BadNamesAndPoliciesAreClearErrors) {
  EXPECT_AMP_ERROR(register_half_function("amp_test::no_such_op"), "no operator 'amp_test::no_such_op'");
  EXPECT_AMP_ERROR(register_half_function("aten::mm.no_such_overload"), "overload");
  EXPECT_AMP_ERROR(register_half_function("mm"), "expected an operator name");
  EXPECT_AMP_ERROR(register_op("aten::relu", CastPolicy::kFp32SetOptDtype), "'ScalarType? dtype'");
  EXPECT_AMP_ERROR(register_op("aten::relu", CastPolicy::kFp32AppendDtype), "reserved");
  EXPECT_AMP_ERROR(register_half_function("aten::relu", c10::kMeta), "CPU and CUDA");
  EXPECT_EQ(policy_table(c10::kCPU).size(), 129u);  // nothing was registered
}

TEST_F(UserRegistrationTest, BannedOpNamesTheSafeAlternativeAndAllowBannedRunsFp32) {
  register_op("aten::binary_cross_entropy", CastPolicy::kBanned, c10::kCPU);
  initialize();
  const auto p = torch::rand({4}) * 0.9 + 0.05, t = torch::rand({4});
  EXPECT_AMP_ERROR(torch::binary_cross_entropy(p.to(at::kBFloat16), t), "binary_cross_entropy_with_logits");
  EXPECT_AMP_ERROR(torch::binary_cross_entropy(p, t), "allow_banned");
  register_op("amp_test::blend", CastPolicy::kBanned, c10::kCPU);  // no built-in row: a generic reason
  EXPECT_AMP_ERROR(call_blend(torch::ones({2}), torch::ones({2})), "registered as banned");
  handle.deinitialize();
  Options allow = quiet(O1);
  allow.allow_banned = true;
  handle.initialize(std::vector<ModulePtr>{}, {}, allow);
  const auto loss = torch::binary_cross_entropy(p.to(at::kBFloat16), t.to(at::kBFloat16));
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  disable_casts exact;
  EXPECT_TRUE(BitEqual(loss, torch::binary_cross_entropy(p.to(at::kBFloat16).to(at::kFloat),
                                                         t.to(at::kBFloat16).to(at::kFloat))));
}

}  // namespace
}  // namespace amp::testing
