// SPDX-License-Identifier: BSD-3-Clause
// O1 interception: ops are cast per policy while amp lives, native LibTorch
// behaviour returns after it, backward never casts.
#include "test_util.h"

#include <ATen/autocast_mode.h>

#include <atomic>
#include <optional>
#include <thread>

namespace amp::testing {
namespace {

using InterceptionTest = AmpTest;
// Tests that run amp on several threads (ThreadSanitizer runs every *ThreadsTest).
class InterceptionThreadsTest : public InterceptionTest {};

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

// A Handle moves with its initialization: the moved-to handle owns it and
// ends it; the moved-from one is inactive and ends nothing.
TEST_F(InterceptionTest, AMovedHandleCarriesItsInitialization) {
  auto model = TinyNet();
  std::optional<Handle> moved_to;
  {
    Handle first;
    first.initialize(model, quiet(O1));
    moved_to.emplace(std::move(first));
    EXPECT_FALSE(first.active());
    EXPECT_TRUE(moved_to->active());
    first.deinitialize();  // a no-op: it owns nothing now
    EXPECT_TRUE(is_initialized());
  }  // the moved-from handle's end changes nothing
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(model->forward(torch::randn({2, 8})).scalar_type(), at::kBFloat16);
  moved_to.reset();
  EXPECT_FALSE(is_initialized());
}

TEST_F(InterceptionTest, CastDtypeRegionCastsToAnotherLowDtypeAndNests) {
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));  // CPU: bfloat16
  const auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
  {
    cast_dtype half(at::kHalf);
    const auto inside = torch::mm(a, b);
    EXPECT_EQ(inside.scalar_type(), at::kHalf);
    {
      disable_casts exact;
      EXPECT_TRUE(BitEqual(inside, torch::mm(a.to(at::kHalf), b.to(at::kHalf))));
    }
    {
      cast_dtype back(at::kBFloat16);
      EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
    }
    EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kHalf);
    EXPECT_EQ(torch::cat({a, b.to(at::kHalf)}).scalar_type(), at::kFloat);  // promote still widens
    EXPECT_EQ(torch::cat({a.to(at::kHalf), b.to(at::kHalf)}).scalar_type(), at::kHalf);
  }
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
  {
    cast_dtype cuda_only(at::kBFloat16, c10::kCUDA);  // CPU keeps its dtype
    cast_dtype cpu_half(at::kHalf, c10::kCPU);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kHalf);
  }
  EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), at::kBFloat16);
  EXPECT_AMP_ERROR(cast_dtype(at::kFloat), "float16 (c10::kHalf) or bfloat16");
  EXPECT_AMP_ERROR(cast_dtype(at::kHalf, c10::kMeta), "CPU or CUDA");
  handle.deinitialize();
  EXPECT_AMP_ERROR(cast_dtype(at::kHalf), "needs amp to be initialized");
}

TEST_F(InterceptionTest, CastDtypeWeightsAreCachedPerDtype) {
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  const auto w = torch::randn({3, 4}, torch::requires_grad()), x = torch::randn({2, 4});
  clear_cast_cache();
  const CastCounts before = cast_counts();
  const auto outside = torch::linear(x, w);
  at::Tensor inside, again;
  {
    cast_dtype half(at::kHalf);
    inside = torch::linear(x, w);
    again = torch::linear(x, w);
  }
  EXPECT_EQ(outside.scalar_type(), at::kBFloat16);
  EXPECT_EQ(inside.scalar_type(), at::kHalf);
  EXPECT_TRUE(BitEqual(inside, again));
  // x cast three times; w once per dtype, then served from the cache.
  EXPECT_EQ(cast_counts().casts - before.casts, 5);
  EXPECT_EQ(cast_counts().cache_hits - before.cache_hits, 1);
}

// Weights edited through .data() between forward passes: the cache cannot
// see it (cast_cache.h); inside disable_cast_cache every op casts afresh.
TEST_F(InterceptionTest, DisableCastCacheSeesWeightsEditedThroughData) {
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  const auto w = torch::randn({3, 4}, torch::requires_grad()), x = torch::randn({2, 4});
  auto exact = [&] {
    disable_casts off;
    return torch::linear(x.to(at::kBFloat16), w.detach().to(at::kBFloat16));
  };
  clear_cast_cache();
  (void)torch::linear(x, w);
  w.data().mul_(2);
  EXPECT_FALSE(BitEqual(torch::linear(x, w), exact())) << "the cached copy is stale, as documented";
  {
    disable_cast_cache fresh;
    EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
    const CastCounts before = cast_counts();
    EXPECT_TRUE(BitEqual(torch::linear(x, w), exact()));
    w.data().mul_(2);
    EXPECT_TRUE(BitEqual(torch::linear(x, w), exact()));
    EXPECT_EQ(cast_counts().cache_hits, before.cache_hits);
    EXPECT_EQ(cast_counts().casts - before.casts, 4);  // x and w, twice
  }
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
}

TEST_F(InterceptionThreadsTest, WithCurrentCastsCarriesTheCastingStateToAWorkerThread) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  const auto x = torch::randn({4, 8});
  struct Seen {
    at::ScalarType dtype;
    bool cache;
    at::ScalarType after;  // the worker's own state once the callable returned
  };
  auto run_on_worker = [&](auto wrapped) {
    Seen seen{};
    std::thread worker([&] {
      seen.dtype = wrapped().scalar_type();
      seen.cache = at::autocast::is_autocast_cache_enabled();
      seen.after = model->forward(x).scalar_type();
    });
    worker.join();
    return seen;
  };
  auto forward = [&] { return model->forward(x); };
  auto forward_and_cache = [&] {
    EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
    return model->forward(x);
  };
  const Seen plain = run_on_worker(forward);
  EXPECT_EQ(plain.dtype, at::kFloat);  // a thread of its own does not cast
  const Seen carried = run_on_worker(with_current_casts(forward));
  EXPECT_EQ(carried.dtype, at::kBFloat16);
  EXPECT_EQ(carried.after, at::kFloat);  // restored when the callable returned
  {
    cast_dtype half(at::kHalf);
    EXPECT_EQ(run_on_worker(with_current_casts(forward)).dtype, at::kHalf);
  }
  {
    disable_casts off;
    EXPECT_EQ(run_on_worker(with_current_casts(forward)).dtype, at::kFloat);
  }
  {
    disable_cast_cache fresh;
    const Seen no_cache = run_on_worker(with_current_casts(forward_and_cache));
    EXPECT_EQ(no_cache.dtype, at::kBFloat16);
    EXPECT_TRUE(no_cache.cache);  // restored
  }
  // Values: several workers at once, each equal to the initializing thread's.
  const auto expected = model->forward(x);
  auto wrapped = with_current_casts([&](const at::Tensor& input) { return model->forward(input); });
  std::vector<at::Tensor> outputs(4);
  std::vector<std::thread> workers;
  for (size_t i = 0; i < outputs.size(); ++i) workers.emplace_back([&, i] { outputs[i] = wrapped(x); });
  for (auto& w : workers) w.join();
  for (const auto& out : outputs) EXPECT_TRUE(BitEqual(out, expected));
  handle.deinitialize();  // no worker scope outlived its callable
  EXPECT_AMP_ERROR(wrapped(x), "needs amp to be initialized");  // casting state it cannot give
}

TEST_F(InterceptionTest, ACastingStateWrittenOutAppliesAsWritten) {
  auto model = TinyNet();
  Handle handle;
  handle.initialize(model, quiet(O1));
  const auto a = torch::randn({2, 2});
  {
    with_casting_state half(CastingState(/*casts=*/true, at::kHalf, at::kHalf, /*cache_enabled=*/false));
    EXPECT_EQ(torch::mm(a, a).scalar_type(), at::kHalf);
    EXPECT_FALSE(CastingState::current().cache_enabled());
    EXPECT_EQ(CastingState::current().dtype(c10::DeviceType::CPU), at::kHalf);
  }
  {
    with_casting_state off(CastingState(/*casts=*/false, at::kBFloat16, at::kHalf, /*cache_enabled=*/true));
    EXPECT_EQ(torch::mm(a, a).scalar_type(), at::kFloat);
    EXPECT_FALSE(CastingState::current().casts());
  }
  EXPECT_EQ(torch::mm(a, a).scalar_type(), at::kBFloat16);  // restored
  EXPECT_TRUE(CastingState::current().cache_enabled());
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

TEST_F(InterceptionThreadsTest, WorkerThreadsCastOnlyInsideEnableCasts) {
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

TEST_F(InterceptionThreadsTest, DeinitializeRefusesWhileWorkersCast) {
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

// A worker opening enable_casts while the initializing thread deinitializes:
// either the scope opens and amp stays live until it ends, or it is refused.
// Never a scope that casts while amp ends under it.
TEST_F(InterceptionThreadsTest, AWorkerOpeningCastsDuringDeinitializeIsCountedOrRefused) {
  int opened = 0, refused = 0, ended_under_a_scope = 0;
  for (int round = 0; round < 300; ++round) {
    auto model = TinyNet();
    amp::initialize(model, quiet(O1));
    std::atomic<bool> go{false};
    std::thread worker([&] {
      while (!go.load()) std::this_thread::yield();
      try {
        enable_casts casts;
        ++opened;
        for (int i = 0; i < 3; ++i) {
          if (!amp::is_initialized()) ++ended_under_a_scope;
          std::this_thread::yield();
        }
      } catch (const c10::Error& e) {
        ++refused;
        EXPECT_THAT(e.what(), ::testing::HasSubstr("enable_casts needs amp to be initialized"));
      }
    });
    go.store(true);
    for (bool ended = false; !ended;) {
      try {
        amp::deinitialize();
        ended = true;
      } catch (const c10::Error& e) {
        EXPECT_THAT(e.what(), ::testing::HasSubstr("enable_casts scope(s) are alive"));
      }
    }
    worker.join();
  }
  EXPECT_EQ(ended_under_a_scope, 0);
  EXPECT_EQ(opened + refused, 300);
}

}  // namespace
}  // namespace amp::testing
