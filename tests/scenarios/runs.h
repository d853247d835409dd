// SPDX-License-Identifier: BSD-3-Clause
// Running a program: under amp at one opt level, and as the oracle - the
// same program in plain LibTorch float64, taking the same skipped steps -
// and what the two must agree on.
#pragma once

#include "program.h"

#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include <torch/types.h>

#include <string>
#include <vector>

namespace amp::scenarios {

using OptimizerPtr = std::shared_ptr<torch::optim::Optimizer>;

// The current scale of loss `loss_id` (reads the device).
inline double loss_scale(int loss_id = 0) { return amp::loss_scaler(loss_id)->scale(); }

// What happened to an optimizer's step in one iteration.
enum Outcome : int64_t { kStepped = 0, kSkipped = 1, kNotStepped = 2 /* its phase threw */ };

struct Trace {
  std::vector<std::vector<int64_t>> outcomes;  // [iteration][optimizer]
  // The scale of a guard's loss_id after every guard that unscaled, in order.
  std::vector<double> scales;
  // [iteration] every parameter stepped (fp32 masters with master weights),
  // optimizer by optimizer, as float64.
  std::vector<std::vector<at::Tensor>> values;
  std::vector<at::Tensor> initial;  // the reference's values before any step
  // Per guard that unscales, in order: the optimizers whose gradients it
  // discarded after an overflow (LibTorch's own optimizers; the fused ones
  // discard at their skipped step).
  std::vector<std::vector<int>> discarded;
};

// How a level runs a program, and what that means for the oracle.
struct LevelRun {
  OptLevel level;
  Options options;          // for amp::initialize
  bool low_storage;         // parameters stored in the low dtype (O3)
  c10::ScalarType compute;  // the dtype amp computes in (float32 at O0)
  bool fp8 = false;         // Linear blocks' GEMMs in float8 (O5 with the fp8 property)
};
LevelRun level_run(const Program& program, OptLevel level);

// Outcomes and scales the program must produce: with the fused optimizers a
// step is skipped exactly when a fault hit a loss whose guard lists its
// optimizer in that phase; with LibTorch's own, the guard that overflowed
// discards the gradients and a later guard's clean ones are stepped. The
// scales follow the scaler's rules from those overflows alone.
Trace expected_trace(const Program& program, const LevelRun& run);

// The oracle: plain LibTorch in float64 (or float32, to measure how
// sensitive each value is to rounding), skipping the expected steps.
Trace run_reference(const Program& program, const LevelRun& run, const Trace& expected, torch::Dtype dtype);

// Under amp. A restart in a fresh process runs `self` (this binary) with
// --resume_from; a run started that way begins at `first_iteration`.
struct AmpRunOptions {
  std::string scratch_dir;
  std::string self;
  std::string resume_from;  // non-empty: load this checkpoint and finish the program
};
Trace run_amp(const Program& program, const LevelRun& run, const AmpRunOptions& options);

// How much each value amplifies rounding: the program in float32 and in
// float64, both with parameters kept unrounded (at O3 rounding the stored
// values to the low dtype would hide the float32 error it measures).
struct Conditioning {
  Trace float64, float32;
};
Conditioning measure_conditioning(const Program& program, const LevelRun& run, const Trace& expected,
                                  const Trace& reference);

// Empty when `actual` agrees with `expected` (outcomes, scales: exact) and
// with `reference` (float64 values, within the level's tolerance, which
// grows with the float32 run's distance from the float64 one); else why
// not. `worst` becomes the largest error seen as a fraction of its tolerance.
std::string compare(const LevelRun& run, const Trace& expected, const Trace& reference,
                    const Conditioning& conditioning, const Trace& actual, double& worst);

// A trace as tensors and back (a fresh-process run reports through a file).
void save_trace(const Trace& trace, const std::string& path);
Trace load_trace(const std::string& path);

}  // namespace amp::scenarios
