// SPDX-License-Identifier: BSD-3-Clause
// Options::keep_cpu_memory: a CPU session's steps reuse the memory the step
// before freed, instead of glibc handing it back to the kernel and faulting
// it in again. Each test runs in a fresh process (a re-executed death
// test): the setting is process-wide, and the parent's malloc has seen
// other tests' blocks.
#include "test_util.h"

#if defined(__GLIBC__)
#include <dlfcn.h>
#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace amp::testing {
namespace {

// A training loop at O1 whose activations are a few MiB each (2048 x 1024):
// one wide linear layer and a chain of elementwise layers, each output kept
// for backward, so the step frees many large blocks at little compute (an
// AVX2 CPU emulates bfloat16: two 1024-wide GEMMs took 95 s a test there).
struct StepLoop {
  torch::nn::Sequential model{torch::nn::Linear(16, 1024), torch::nn::ReLU(), torch::nn::Tanh(), torch::nn::GELU(),
                              torch::nn::Sigmoid(), torch::nn::Tanh(), torch::nn::Linear(1024, 10)};
  torch::optim::SGD optimizer{model->parameters(), 0.01};
  at::Tensor input = torch::randn({2048, 16});
  at::Tensor target = torch::randint(10, {2048});

  // malloc_gives_back: the process first fixes glibc's threshold at its
  // starting value (128 KiB), so each activation block is mapped when
  // allocated and unmapped when freed. Left to itself glibc moves the
  // threshold and trims the heap's top by what the process's history left
  // there, which no test can control (a build at -O0 kept every page).
  StepLoop(bool keep_cpu_memory, bool malloc_gives_back) {
    if (malloc_gives_back && mallopt(M_MMAP_THRESHOLD, 128 << 10) != 1) std::abort();
    Options options = O1;
    options.verbosity = 0;
    options.keep_cpu_memory = keep_cpu_memory;
    amp::initialize(model, optimizer, options);
  }
  void step() {
    optimizer.zero_grad();
    {
      amp::scale_loss scaled(torch::cross_entropy_loss(model->forward(input), target), optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
  // The fewest page faults in four steps, over three runs of four steps
  // once the loop has warmed up. Kept memory reaches a steady state (0
  // faults a step) after the heap has grown to the step's peak, which a
  // run of four may still see happen (a 4 or 8 MiB block placed at the
  // heap's top, as in an unoptimized build); memory given back faults
  // every step, in every run.
  long fewest_faults_in_four_steps() {
    for (int i = 0; i < 6; ++i) step();
    long fewest = std::numeric_limits<long>::max();
    for (int run = 0; run < 3; ++run) {
      struct rusage before {}, after {};
      getrusage(RUSAGE_SELF, &before);
      for (int i = 0; i < 4; ++i) step();
      getrusage(RUSAGE_SELF, &after);
      fewest = std::min(fewest, after.ru_minflt - before.ru_minflt);
    }
    return fewest;
  }
};

// A sanitizer's allocator stands in for glibc's malloc, which the option
// sets. The suite's objects are not instrumented themselves (they link into
// the sanitized binaries), so the runtime is looked for when the test runs.
bool under_a_sanitizer() {
  return dlsym(RTLD_DEFAULT, "__asan_init") != nullptr || dlsym(RTLD_DEFAULT, "__tsan_init") != nullptr;
}
#define SKIP_UNDER_A_SANITIZER() \
  if (under_a_sanitizer()) GTEST_SKIP() << "a sanitizer's allocator replaces glibc's malloc, which keep_cpu_memory sets"

// Measured on a 2-core AVX2 EPYC, the fewest of three runs of four steps, a
// process each: 49,200 faults with the threshold fixed at 128 KiB (every
// run), 0 kept, from glibc's defaults or from that threshold. The heap may
// still grow once in a run (a 4 or 8 MiB block placed at its top, as in an
// unoptimized build: hence the fewest of three). Under load a build has
// seen one 4 MiB block (1024 pages) fault in during each of the three runs:
// the line sits at 16 MiB, still a twelfth of what memory given back faults.
void exit_with(long faults, bool reused) {
  constexpr long kFew = 4096;
  if ((faults < kFew) == reused) std::exit(0);
  std::fprintf(stderr, "the fewest faults in four steps were %ld pages (expected %s %ld)\n", faults,
               reused ? "under" : "at least", kFew);
  std::exit(1);
}

TEST_F(AmpTest, ACpuSessionReusesTheMemoryTheStepBeforeFreed) {
  SKIP_UNDER_A_SANITIZER();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_with(StepLoop(/*keep_cpu_memory=*/true, /*malloc_gives_back=*/false).fewest_faults_in_four_steps(),
                        /*reused=*/true),
              ::testing::ExitedWithCode(0), "");
}

// amp's setting replaces one the process made before initialize.
TEST_F(AmpTest, ACpuSessionReusesMemoryWhereMallocWasSetToGiveItBack) {
  SKIP_UNDER_A_SANITIZER();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_with(StepLoop(/*keep_cpu_memory=*/true, /*malloc_gives_back=*/true).fewest_faults_in_four_steps(),
                        /*reused=*/true),
              ::testing::ExitedWithCode(0), "");
}

// The control: without the option the same malloc faults the same steps'
// pages in again, so the test above would fail without amp's setting.
TEST_F(AmpTest, KeepCpuMemoryOffLeavesMallocAsItWas) {
  SKIP_UNDER_A_SANITIZER();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_with(StepLoop(/*keep_cpu_memory=*/false, /*malloc_gives_back=*/true).fewest_faults_in_four_steps(),
                        /*reused=*/false),
              ::testing::ExitedWithCode(0), "");
}

// How many "keeps_cpu_memory" notes one initialize of a CPU model logs.
int notes_of_one_initialize(bool keep_cpu_memory) {
  auto model = torch::nn::Linear(4, 2);
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Options options = O1;
  options.keep_cpu_memory = keep_cpu_memory;
  LogRecorder log;
  Handle handle;
  handle.initialize(model, optimizer, options);
  return log.count(LogEvent::Kind::kNote, "keeps_cpu_memory");
}

void exit_with_notes(int off, int first, int again) {
  if (off == 0 && first == 1 && again == 0) std::exit(0);
  std::fprintf(stderr, "keeps_cpu_memory notes: %d with the option off, %d at the first initialize with it "
               "on, %d at the next (expected 0, 1, 0)\n", off, first, again);
  std::exit(1);
}

// The process-wide change is told once, when it is made: not while the
// option is off, and not again at later sessions.
TEST_F(AmpTest, TheProcessWideMallocChangeIsNotedOnce) {
  SKIP_UNDER_A_SANITIZER();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const int off = notes_of_one_initialize(false);
        const int first = notes_of_one_initialize(true);
        exit_with_notes(off, first, notes_of_one_initialize(true));
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace amp::testing

#else
TEST(CpuMemory, NeedsGlibc) { GTEST_SKIP() << "Options::keep_cpu_memory sets glibc's malloc; this C library is not glibc"; }
#endif
