// SPDX-License-Identifier: BSD-3-Clause
// Options::measured_policy (amp/measured_policy.h): GEMMs and convolutions
// run in float32 where that was measured faster at their shape, with O0's
// values; the choice is kept, saved and loaded; off, nothing is measured.
#include "test_util.h"

#include <amp/measured_policy.h>

#include "interception/measured_policy.h"

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <future>
#include <thread>
#include <vector>

namespace amp::testing {
namespace {

class MeasuredPolicyTest : public AmpTest {
 protected:
  void SetUp() override { clear_measured_policy(); }
  void TearDown() override { clear_measured_policy(); }
  static Options measured() {
    Options options = quiet(O1);
    options.measured_policy = true;
    return options;
  }
};

// The first call of each shape is timed both ways and the choice applied;
// the same shape then gets the same choice without timing again.
TEST_F(MeasuredPolicyTest, MeasuresEachShapeOnceAndAppliesTheChoice) {
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, measured());
  const at::Tensor a = torch::randn({32, 48}), b = torch::randn({48, 16}), c = torch::randn({8, 48});
  const at::Tensor first = at::mm(a, b);
  ASSERT_EQ(measured_policy().size(), 1u);
  const MeasuredChoice choice = measured_policy().front();
  EXPECT_EQ(choice.op, "aten::mm");
  EXPECT_EQ(choice.shapes, "[32, 48] Float, [48, 16] Float");
  EXPECT_EQ(choice.low, "BFloat16");
  EXPECT_GT(choice.low_ms, 0.0);
  EXPECT_GT(choice.fp32_ms, 0.0);
  EXPECT_EQ(first.scalar_type(), choice.keeps_fp32 ? at::kFloat : at::kBFloat16);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(at::mm(a, b).scalar_type(), first.scalar_type());
  EXPECT_EQ(measured_policy().size(), 1u) << "one shape, one measurement";
  at::mm(c, b);
  EXPECT_EQ(measured_policy().size(), 2u) << "a new shape is measured";
  at::relu(a);
  EXPECT_EQ(measured_policy().size(), 2u) << "only GEMMs and convolutions";
  clear_measured_policy();
  at::mm(a, b);
  EXPECT_EQ(measured_policy().size(), 1u) << "measured again once the table is cleared";
}

// The choice follows the timings, here the test's own in place of the
// timing runs: float32 where it measured at least 5% faster, the low dtype
// where it was slower or nearly as fast (timing noise leaves autocast's
// choice standing).
TEST_F(MeasuredPolicyTest, TheChoiceFollowsTheTimings) {
  struct Case {
    double low_ms, fp32_ms;
    at::ScalarType runs_in;
    const char* why;
  };
  const Case cases[] = {
      {2.0, 1.0, at::kFloat, "float32 twice as fast"},
      {1.0, 0.9, at::kFloat, "float32 10% faster"},
      {1.0, 0.97, at::kBFloat16, "float32 3% faster: within timing noise"},
      {1.0, 1.0, at::kBFloat16, "a tie"},
      {1.0, 2.0, at::kBFloat16, "float32 twice as slow"},
  };
  const at::Tensor a = torch::randn({32, 48}), b = torch::randn({48, 16});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.why);
    clear_measured_policy();
    int measured_times = 0;
    Options options = measured();
    options.measured_policy_timer = [&](const std::string& op, const std::string& shapes,
                                        const std::function<void()>&, const std::function<void()>&) {
      ++measured_times;
      EXPECT_EQ(op, "aten::mm");
      EXPECT_EQ(shapes, "[32, 48] Float, [48, 16] Float");
      return std::make_pair(c.low_ms, c.fp32_ms);
    };
    Handle handle;
    handle.initialize(std::vector<ModulePtr>{}, {}, options);
    EXPECT_EQ(at::mm(a, b).scalar_type(), c.runs_in);
    EXPECT_EQ(at::mm(a, b).scalar_type(), c.runs_in);
    EXPECT_EQ(measured_times, 1);
    ASSERT_EQ(measured_policy().size(), 1u);
    const MeasuredChoice choice = measured_policy().front();
    EXPECT_EQ(choice.low_ms, c.low_ms);
    EXPECT_EQ(choice.fp32_ms, c.fp32_ms);
    EXPECT_EQ(choice.keeps_fp32, c.runs_in == at::kFloat);
  }
}

// The dtypes of the aten::mm calls a timer's runs make (recorded while
// `timer_running`; RecordFunction takes plain function pointers).
std::vector<at::ScalarType> timer_run_dtypes;
bool timer_running = false;
std::unique_ptr<at::ObserverContext> record_timed_mm(const at::RecordFunction& fn) {
  const auto inputs = fn.inputs();
  if (timer_running && std::string(fn.name()) == "aten::mm" && !inputs.empty() && inputs[0].isTensor()) {
    timer_run_dtypes.push_back(inputs[0].toTensor().scalar_type());
  }
  return nullptr;
}

// A timer of the program's own is handed the two runs: each runs the op
// once in its dtype, and what the timer returns decides. A timer without
// the measured policy is refused, and nothing is initialized.
TEST_F(MeasuredPolicyTest, AProgramsOwnTimerRunsBothCandidatesAndDecides) {
  std::vector<at::ScalarType>& seen = timer_run_dtypes;
  seen.clear();
  Options options = measured();
  options.measured_policy_timer = [&](const std::string&, const std::string&, const std::function<void()>& run_low,
                                      const std::function<void()>& run_fp32) {
    timer_running = true;
    run_low();
    seen.push_back(at::kByte);  // a separator: low's calls, then float32's
    run_fp32();
    timer_running = false;
    return std::make_pair(2.0, 1.0);  // float32 "faster"
  };
  const at::CallbackHandle callback =
      at::addThreadLocalCallback(at::RecordFunctionCallback(record_timed_mm).needsInputs(true));
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, options);
  const at::ScalarType result = at::mm(torch::randn({16, 8}), torch::randn({8, 4})).scalar_type();
  at::removeCallback(callback);
  EXPECT_EQ(result, at::kFloat) << "the timer found float32 faster";
  const auto separator = std::find(seen.begin(), seen.end(), at::kByte);
  ASSERT_NE(separator, seen.end()) << "the timer ran";
  EXPECT_NE(std::find(seen.begin(), separator, at::kBFloat16), separator) << "run_low ran the GEMM in bfloat16";
  EXPECT_EQ(std::find(seen.begin(), separator, at::kFloat), separator) << "run_low ran no float32 GEMM";
  EXPECT_NE(std::find(separator, seen.end(), at::kFloat), seen.end()) << "run_fp32 ran the GEMM in float32";
  EXPECT_EQ(std::find(separator, seen.end(), at::kBFloat16), seen.end()) << "run_fp32 ran no bfloat16 GEMM";
  handle.deinitialize();

  Options inert = quiet(O1);
  inert.measured_policy_timer = options.measured_policy_timer;
  EXPECT_THAT([&] { amp::initialize(std::vector<ModulePtr>{}, {}, inert); },
              ::testing::ThrowsMessage<c10::Error>(
                  ::testing::HasSubstr("measured_policy_timer is set but measured_policy is false")));
  EXPECT_FALSE(amp::is_initialized());
}

// Where float32 is kept, the op gives O0's values bit for bit and
// autograd runs through it in float32; where the low dtype is kept, native
// autocast's.
TEST_F(MeasuredPolicyTest, KeptOpsGiveO0sValuesAndOthersAutocasts) {
  const at::Tensor x = torch::randn({16, 24}, torch::requires_grad()), w = torch::randn({12, 24});
  const at::Tensor plain = at::linear(x, w);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  const at::Tensor native = at::linear(x, w);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  const std::string path = ::testing::TempDir() + "amp_measured_policy.txt";
  for (bool keep : {true, false}) {
    SCOPED_TRACE(keep ? "float32 kept" : "low dtype kept");
    {
      std::ofstream file(path);
      file << "aten::linear\t0\t[16, 24] Float, [12, 24] Float\tBFloat16\t2\t1\t" << (keep ? 1 : 0) << "\n";
    }
    load_measured_policy(path);
    Handle handle;
    handle.initialize(std::vector<ModulePtr>{}, {}, measured());
    const at::Tensor y = at::linear(x, w);
    EXPECT_TRUE(BitEqual(y, keep ? plain : native));
    y.sum().backward();
    EXPECT_EQ(x.grad().scalar_type(), at::kFloat);
    x.mutable_grad() = at::Tensor();
    EXPECT_EQ(measured_policy().size(), 1u) << "loaded, not measured again; backward is never measured";
  }
  std::remove(path.c_str());
}

// The timing runs draw no random numbers and leave the program's graph
// alone: attention with dropout gives the same values and the same next
// draws whether its shape was just measured or already decided.
TEST_F(MeasuredPolicyTest, TimingRunsLeaveRandomStreamsAndGraphsAlone) {
  const at::Tensor q = torch::randn({2, 2, 8, 4}, torch::requires_grad());
  auto call = [&] {
    torch::manual_seed(7);
    const at::Tensor y = at::scaled_dot_product_attention(q, q, q, {}, /*dropout_p=*/0.5);
    return std::make_pair(y, torch::rand({4}));
  };
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, measured());
  const auto [measuring, next_draw] = call();
  ASSERT_EQ(measured_policy().size(), 1u);
  const auto [decided, decided_next_draw] = call();
  EXPECT_TRUE(BitEqual(measuring, decided));
  EXPECT_TRUE(BitEqual(next_draw, decided_next_draw));
  measuring.sum().backward();
  const at::Tensor first_grad = q.grad().clone();
  q.mutable_grad() = at::Tensor();
  decided.sum().backward();
  EXPECT_TRUE(BitEqual(first_grad, q.grad())) << "the measured call's graph is the program's own";
}

// The table saves and loads: the same choices, no new measurement.
TEST_F(MeasuredPolicyTest, SavedChoicesLoadAndDecideAlike) {
  const std::string path = ::testing::TempDir() + "amp_measured_policy_round_trip.txt";
  std::vector<at::ScalarType> dtypes;
  {
    Handle handle;
    handle.initialize(std::vector<ModulePtr>{}, {}, measured());
    for (int64_t n : {8, 64, 256}) dtypes.push_back(at::mm(torch::randn({n, n}), torch::randn({n, n})).scalar_type());
    save_measured_policy(path);
  }
  const std::vector<MeasuredChoice> saved = measured_policy();
  clear_measured_policy();
  load_measured_policy(path);
  ASSERT_EQ(measured_policy().size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_EQ(measured_policy()[i].shapes, saved[i].shapes);
    EXPECT_EQ(measured_policy()[i].keeps_fp32, saved[i].keeps_fp32);
  }
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, measured());
  size_t i = 0;
  for (int64_t n : {8, 64, 256}) EXPECT_EQ(at::mm(torch::randn({n, n}), torch::randn({n, n})).scalar_type(), dtypes[i++]);
  EXPECT_EQ(measured_policy().size(), saved.size());
  EXPECT_NE(format_measured_policy(measured_policy()).find("aten::mm"), std::string::npos);
  std::remove(path.c_str());
}

class MeasuredPolicyThreadsTest : public MeasuredPolicyTest {};

// Threads share one table: a shape is measured once, by whichever thread
// comes first, and every thread applies the table's choice; a table loaded
// while the threads live replaces what each had decided.
TEST_F(MeasuredPolicyThreadsTest, ThreadsShareOneTableAndFollowALoad) {
  constexpr int kThreads = 4, kCalls = 20;
  Handle handle;
  handle.initialize(std::vector<ModulePtr>{}, {}, measured());
  const at::Tensor a = torch::randn({16, 24}), b = torch::randn({24, 8});
  std::vector<std::vector<at::ScalarType>> before(kThreads), after(kThreads);
  std::atomic<int> decided{0};
  std::promise<void> loaded;
  std::shared_future<void> load_done = loaded.get_future().share();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      enable_casts casts;
      for (int i = 0; i < kCalls; ++i) before[t].push_back(at::mm(a, b).scalar_type());
      decided.fetch_add(1);
      load_done.wait();
      for (int i = 0; i < kCalls; ++i) after[t].push_back(at::mm(a, b).scalar_type());
    });
  }
  while (decided.load() < kThreads) std::this_thread::yield();
  ASSERT_EQ(measured_policy().size(), 1u) << "one shape, measured once";
  const bool kept_fp32 = measured_policy().front().keeps_fp32;
  const std::string path = ::testing::TempDir() + "amp_measured_policy_threads.txt";
  {
    std::ofstream file(path);
    file << "aten::mm\t0\t[16, 24] Float, [24, 8] Float\tBFloat16\t1\t1\t" << (kept_fp32 ? 0 : 1) << "\n";
  }
  load_measured_policy(path);  // the other choice
  loaded.set_value();
  for (auto& thread : threads) thread.join();
  std::remove(path.c_str());
  const at::ScalarType first = kept_fp32 ? at::kFloat : at::kBFloat16, second = kept_fp32 ? at::kBFloat16 : at::kFloat;
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(before[t], std::vector<at::ScalarType>(kCalls, first)) << "thread " << t;
    EXPECT_EQ(after[t], std::vector<at::ScalarType>(kCalls, second)) << "thread " << t << " after the load";
  }
  EXPECT_EQ(measured_policy().size(), 1u) << "loaded, not measured again";
}

TEST_F(MeasuredPolicyTest, OffMeasuresNothingAndBadFilesLoadNothing) {
  {
    Handle handle;
    handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
    EXPECT_EQ(at::mm(torch::randn({8, 8}), torch::randn({8, 8})).scalar_type(), at::kBFloat16);
    EXPECT_TRUE(measured_policy().empty());
  }
  const std::string path = ::testing::TempDir() + "amp_measured_policy_bad.txt";
  {
    std::ofstream file(path);
    file << "aten::mm\t0\t[8, 8] Float, [8, 8] Float\tBFloat16\t1\t2\t0\nnot a line\n";
  }
  EXPECT_AMP_ERROR(load_measured_policy(path), "line 2");
  EXPECT_TRUE(measured_policy().empty()) << "nothing loaded";
  EXPECT_AMP_ERROR(load_measured_policy(path + ".missing"), "cannot read");
  std::remove(path.c_str());
}

}  // namespace
}  // namespace amp::testing
