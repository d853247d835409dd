// O1 interception: ops are cast per policy while amp lives, native LibTorch
// behaviour returns after it, backward never casts.
#include "test_util.h"

#include <ATen/autocast_mode.h>

#include <thread>

namespace amp::testing {
namespace {

using InterceptionTest = AmpTest;

TEST_F(InterceptionTest, LowerPrecisionOpsRunInBf16OnCpuByDefault) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  const auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
  EXPECT_EQ(model->forward(torch::randn({2, 8})).scalar_type(), at::kBFloat16);
  EXPECT_EQ(torch::relu(a).scalar_type(), at::kFloat);  // not in the tables: untouched
}

TEST_F(InterceptionTest, CpuDtypeOptionSelectsFloat16) {
  Options options = quiet(O1);
  options.cpu_dtype = at::kHalf;
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, options);
  EXPECT_EQ(torch::mm(torch::randn({3, 3}), torch::randn({3, 3})).scalar_type(), at::kHalf);
}

TEST_F(InterceptionTest, Fp32OpsCastLowPrecisionInputsUp) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  const auto logits = torch::randn({4, 3}).to(at::kBFloat16);
  const auto target = torch::tensor({0, 1, 2, 0});
  EXPECT_EQ(torch::nll_loss(logits, target).scalar_type(), at::kFloat);
  EXPECT_EQ(torch::cdist(logits, logits).scalar_type(), at::kFloat);
}

TEST_F(InterceptionTest, PromoteAndSequencePromote) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  const auto low = torch::randn({2, 3}).to(at::kBFloat16);
  const auto full = torch::randn({2, 3});
  EXPECT_EQ(torch::cat({low, full}).scalar_type(), at::kFloat);            // mixed: widest
  EXPECT_EQ(torch::stack({low, low}).scalar_type(), at::kBFloat16);        // one dtype passes
  EXPECT_EQ(torch::stack({low, full, low}).scalar_type(), at::kFloat);
  EXPECT_EQ(torch::cat({full.to(at::kDouble), low}).scalar_type(), at::kDouble);  // f64 left alone
}

TEST_F(InterceptionTest, InPlaceAndOutVariantsKeepTheirDestinationDtype) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  // In-place and out= overloads are not in the tables (as in LibTorch): they
  // run in the destination's dtype, never silently change it.
  auto x = torch::rand({3, 3}).to(at::kBFloat16);
  const auto reference = x.clone().exp_();
  x.exp_();
  EXPECT_TRUE(BitEqual(x, reference));
  auto out = torch::empty({3, 3});
  torch::mm_out(out, torch::randn({3, 3}), torch::randn({3, 3}));
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  auto acc = torch::zeros({2, 2}, at::kBFloat16);
  acc.addcmul_(torch::ones({2, 2}), torch::ones({2, 2}));
  EXPECT_EQ(acc.scalar_type(), at::kBFloat16);
}

TEST_F(InterceptionTest, DeinitializeRestoresNativeAutocastExactly) {
  const auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  ASSERT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  {
    auto model = TinyNet();
    Handle handle;
    handle.initialize(model, quiet(O1));
    EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
    EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), at::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCUDA));
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
  // Native autocast works again with its own (uncached, unpoliced-by-amp) kernels.
  at::autocast::set_autocast_dtype(at::kCPU, at::kHalf);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  const auto native = torch::mm(a, b);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  EXPECT_EQ(native.scalar_type(), at::kHalf);
  EXPECT_TRUE(BitEqual(native, torch::mm(a.to(at::kHalf), b.to(at::kHalf))));
}

TEST_F(InterceptionTest, InitializingTwiceIsAnError) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  auto other = TinyNet();
  EXPECT_AMP_ERROR(amp::initialize(other, quiet(O1)), "already initialized");
  EXPECT_TRUE(handle.active());
}

TEST_F(InterceptionTest, OnlyItsHandleEndsAHandlesInitialization) {
  auto model = TinyNet();
  {
    Handle handle;
    handle.initialize(model, quiet(O1));
    const auto x = torch::randn({2, 8});
    EXPECT_AMP_ERROR(amp::deinitialize(), "handle.deinitialize()");
    EXPECT_TRUE(handle.active());
    EXPECT_EQ(model->forward(x).scalar_type(), at::kBFloat16);  // still casting
  }  // the handle ends it
  EXPECT_FALSE(is_initialized());
  auto other = TinyNet();
  amp::initialize(other, quiet(O1));  // the free functions own theirs
  amp::deinitialize();
  EXPECT_FALSE(is_initialized());
}

TEST_F(InterceptionTest, DisableCastsNestsAndSurvivesExceptions) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  const auto a = torch::randn({2, 2});
  {
    disable_casts outer;
    EXPECT_EQ(torch::mm(a, a).scalar_type(), at::kFloat);
    {
      disable_casts inner;
      EXPECT_EQ(torch::mm(a, a).scalar_type(), at::kFloat);
    }
    EXPECT_EQ(torch::mm(a, a).scalar_type(), at::kFloat);  // inner restored only its delta
  }
  EXPECT_EQ(torch::mm(a, a).scalar_type(), at::kBFloat16);
  try {
    disable_casts scope;
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(torch::mm(a, a).scalar_type(), at::kBFloat16);
}

TEST_F(InterceptionTest, BackwardNeverCastsAndGradsMatchInputDtypes) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  const auto x = torch::randn({5, 8}, torch::requires_grad());
  const auto loss = model->forward(x).to(at::kFloat).pow(2).sum();
  OpStatsRecorder recorder;
  loss.backward();  // outside scale_loss: amp's kernels run but must not cast
  int64_t backward_calls = 0;
  for (const OpStats& row : recorder.stats()) {
    EXPECT_TRUE(row.in_backward) << row.op << " ran in forward during backward";
    EXPECT_EQ(row.casts, 0) << row.op;
    EXPECT_EQ(row.policy, CastPolicy::kPassthrough) << row.op;
    backward_calls += row.calls;
  }
  EXPECT_GT(backward_calls, 0);  // mm/addmm in backward did reach amp's kernels
  EXPECT_EQ(x.grad().scalar_type(), at::kFloat);
  for (const auto& p : model->parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
}

TEST_F(InterceptionTest, WorkerThreadsCastOnlyInsideEnableCasts) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  at::ScalarType without = at::kDouble, with = at::kDouble;
  std::thread worker([&] {
    const auto a = torch::randn({2, 2});
    without = torch::mm(a, a).scalar_type();
    enable_casts casts;
    with = torch::mm(a, a).scalar_type();
  });
  worker.join();
  EXPECT_EQ(without, at::kFloat);
  EXPECT_EQ(with, at::kBFloat16);
}

TEST_F(InterceptionTest, DeinitializeRefusesWhileWorkersCast) {
  auto model = TinyNet();
  amp::initialize(model, quiet(O1));
  std::mutex m;
  std::condition_variable cv;
  bool started = false, release = false;
  std::thread worker([&] {
    enable_casts casts;
    std::unique_lock<std::mutex> lock(m);
    started = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
  });
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return started; });
  }
  EXPECT_AMP_ERROR(amp::deinitialize(), "enable_casts");
  EXPECT_TRUE(amp::is_initialized());
  {
    std::lock_guard<std::mutex> lock(m);
    release = true;
  }
  cv.notify_all();
  worker.join();
  amp::deinitialize();
  EXPECT_FALSE(amp::is_initialized());
}

}  // namespace
}  // namespace amp::testing
