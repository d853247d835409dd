// SPDX-License-Identifier: BSD-3-Clause
// Random training programs under amp at every opt level, each checked
// against the same program in float64 (see program.h, runs.h):
//
//   scenarios --seeds=300              seeds 1..300, every level
//   scenarios --seed=1234 --opt_level=O2   one program, one level
//
// A failure prints the program and the one-line command that reproduces it.
#include "program.h"
#include <amp/internal/level_rules.h>
#include "runs.h"

#include <algorithm>
#include <absl/flags/flag.h>
#include <absl/flags/parse.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>

#include <limits.h>
#include <unistd.h>

ABSL_FLAG(int64_t, seed, -1, "run this one seed (else --first_seed .. --first_seed + --seeds - 1)");
ABSL_FLAG(int64_t, first_seed, 1, "first seed of the range");
ABSL_FLAG(int64_t, seeds, 100, "number of seeds");
ABSL_FLAG(std::string, opt_level, "", "one level (O0..O6); empty: all");
ABSL_FLAG(bool, verbose, false, "print every program and the worst error per level");
ABSL_FLAG(std::string, resume_from, "", "internal: finish the program from this checkpoint in this process");
ABSL_FLAG(std::string, trace_out, "", "internal: where --resume_from writes its trace");

namespace {

using namespace amp::scenarios;

std::string self_path() {
  char buffer[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  return n > 0 ? std::string(buffer, n) : std::string("scenarios");
}

// How many of the programs run exercised each feature: a generator that
// stopped drawing one would show here.
struct Coverage {
  std::map<std::string, int> count;
  void add(const Program& p) {
    const auto any_loss = [&](auto pred) {
      for (const auto& phase : p.phases) {
        for (const auto& loss : phase.losses) {
          if (pred(phase, loss)) return true;
        }
      }
      return false;
    };
    count["several models"] += p.models.size() > 1;
    count["two optimizers"] += p.optimizers.size() > 1;
    count["phase per optimizer (GAN)"] += p.phases.size() > 1;
    count["loss crossing models"] += any_loss([](const Phase&, const LossSpec& l) { return l.chain.size() > 1; });
    count["detached chain"] += any_loss([](const Phase&, const LossSpec& l) { return l.detach_after >= 0; });
    count["accumulation"] += any_loss([](const Phase& ph, const LossSpec&) { return ph.micro_batches > 1; });
    count["unscale + clip"] += any_loss([](const Phase&, const LossSpec& l) { return l.clip.has_value(); });
    count["gradient penalty"] += any_loss([](const Phase&, const LossSpec& l) { return l.penalty > 0; });
    count["num_losses > 1"] += p.num_losses > 1;
    count["zero via optimizer"] += p.zero == Zero::kOptimizer;
    count["zero via model"] += p.zero == Zero::kModel;
    count["never zero"] += p.zero == Zero::kNever;
    count["LibTorch's own optimizer step"] += !p.fused_step;
    count["injected faults"] += !p.faults.empty();
    count["exception in guard"] += p.exception.has_value();
    count["restart"] += p.restart_before.has_value();
    count["fresh-process restart"] += p.fresh_process_level.has_value();
    count["float16 at O1-O3"] += p.float16;
    count["fp8 at O5"] += p.fp8;
    count["step in backward"] += p.step_in_backward;
    count["sharded (ZeRO-2)"] += p.sharding == Program::Sharding::kZero2;
    count["sharded weights (ZeRO-3)"] += p.sharding == Program::Sharding::kZero3;
    const auto recomputes = [&](bool nested) {
      return std::any_of(p.models.begin(), p.models.end(),
                         [&](const ModelSpec& m) { return m.recomputed && (!nested || m.recomputed->nested); });
    };
    count["recomputed blocks"] += recomputes(false);
    count["nested recomputation"] += recomputes(true);
    count["selective recomputation (amp::Keep)"] += std::any_of(p.models.begin(), p.models.end(), [](const ModelSpec& m) {
      return m.recomputed && m.recomputed->keep != Kept::kNothing;
    });
    count["recomputation in slices"] += std::any_of(p.models.begin(), p.models.end(), [](const ModelSpec& m) {
      return m.recomputed && m.recomputed->slices > 1;
    });
    const auto reads_table = [&](auto pred) {
      return std::any_of(p.models.begin(), p.models.end(), [&](const ModelSpec& m) {
        const auto at = std::find(m.blocks.begin(), m.blocks.end(), Block::kTableView);
        return at != m.blocks.end() && pred(m, static_cast<size_t>(at - m.blocks.begin()));
      });
    };
    count["weight read through a view"] += reads_table([](const ModelSpec&, size_t) { return true; });
    count["view as a forward's first op"] +=
        reads_table([](const ModelSpec& m, size_t at) { return at == 0 && !m.token_input; });
    count["view inside a recomputed block"] += reads_table([](const ModelSpec& m, size_t at) {
      return m.recomputed && at >= m.recomputed->first && at < m.recomputed->last;
    });
  }
};

std::string message(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::vector<amp::OptLevel> levels = amp::internal::all_opt_levels();
  if (!absl::GetFlag(FLAGS_opt_level).empty()) levels = {amp::parse_opt_level(absl::GetFlag(FLAGS_opt_level))};

  if (!absl::GetFlag(FLAGS_resume_from).empty()) {  // the fresh process of a restart
    const Program p = generate_program(absl::GetFlag(FLAGS_seed));
    AmpRunOptions options;
    options.resume_from = absl::GetFlag(FLAGS_resume_from);
    save_trace(run_amp(p, level_run(p, levels.front()), options), absl::GetFlag(FLAGS_trace_out));
    return 0;
  }

  int64_t first = absl::GetFlag(FLAGS_first_seed), count = absl::GetFlag(FLAGS_seeds);
  if (absl::GetFlag(FLAGS_seed) >= 0) first = absl::GetFlag(FLAGS_seed), count = 1;
  AmpRunOptions options;
  options.self = self_path();
  options.scratch_dir = (std::filesystem::temp_directory_path() / ("amp_scenarios_" + std::to_string(getpid()))).string();
  std::filesystem::create_directories(options.scratch_dir);

  const auto start = std::chrono::steady_clock::now();
  std::map<amp::OptLevel, double> worst;
  Coverage coverage;
  int runs = 0, failures = 0;
  for (int64_t seed = first; seed < first + count; ++seed) {
    const Program p = generate_program(seed);
    coverage.add(p);
    if (absl::GetFlag(FLAGS_verbose)) std::cout << "seed " << seed << ":\n" << describe(p);
    for (amp::OptLevel level : levels) {
      ++runs;
      std::string failure;
      try {
        const LevelRun run = level_run(p, level);
        const Trace expected = expected_trace(p, run);
        const Trace reference = run_reference(p, run, expected, torch::kDouble);
        const Conditioning conditioning = measure_conditioning(p, run, expected, reference);
        const Trace actual = run_amp(p, run, options);
        failure = compare(run, expected, reference, conditioning, actual, worst[level]);
      } catch (const std::exception& e) {
        failure = "threw: " + message(e);
      }
      if (failure.empty()) continue;
      ++failures;
      std::cout << "FAILED seed " << seed << " at " << amp::to_string(level) << ": " << failure << "\n"
                << describe(p) << "  reproduce: " << options.self << " --seed=" << seed
                << " --opt_level=" << amp::to_string(level) << "\n";
    }
  }
  rmdir(options.scratch_dir.c_str());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "scenarios: seeds " << first << ".." << first + count - 1 << ", " << runs << " runs, " << failures
            << " failed, " << seconds << " s\n";
  std::cout << "  largest error as a fraction of its tolerance:";
  for (const auto& [level, w] : worst) std::cout << " " << amp::to_string(level) << " " << w;
  std::cout << "\n  programs with:";
  for (const auto& [feature, n] : coverage.count) std::cout << " " << feature << " " << n << ";";
  std::cout << "\n";
  return failures == 0 ? 0 : 1;
}
