// SPDX-License-Identifier: BSD-3-Clause
// What every example shares: turning --opt_level/--dtype/--device flags into
// amp::Options and a device, with clear errors, and a progress line.
#pragma once

#include <amp/options.h>

#include <c10/core/Device.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>

namespace examples {

// Throws std::invalid_argument with a message that names the flag.
// `opt_level`: O0..O6, or O5+fp8 (the fp8 property on top of O5, with
// --fp8_min_gemm_intensity where set).
amp::Options amp_options(const std::string& opt_level, const std::string& dtype,
                         c10::Device device, int verbosity = 1);
c10::Device parse_device(const std::string& device);
// The level as --opt_level names it: "O5+fp8" with the fp8 property.
std::string level_name(const amp::Options& options);

// A program's main: parses the Abseil flags, starts counting the CPU
// allocator's bytes (amp::track_allocations), runs `run` and turns exceptions
// into "<program>: <message>" on stderr (c10::Error without its C++
// frames), exit code 2 for bad flags (std::invalid_argument), 1 otherwise.
int run_main(int argc, char** argv, const char* usage, const std::function<int()>& run);

// Whether the --optimizer flag asks for amp's fused optimizer: "fused" yes,
// "libtorch" no; "" picks it where the level needs it (O6's stochastic
// rounding happens in amp's fused optimizers), or the whole step is captured
// in a CUDA graph (`cuda_graph`), and LibTorch's own otherwise.
bool use_fused_optimizer(const std::string& flag, const amp::Options& options, bool cuda_graph = false);

// The process's peak resident memory so far, in MiB.
double peak_rss_mib();
// The most bytes LibTorch's allocator held for tensors on `device` at once, in MiB.
double peak_allocated_mib(c10::Device device);

// Prints "step N/T  loss L  scale S  X samples/s  ETA m:ss", rewritten in
// place on a terminal, as plain lines every `every` steps otherwise. The ETA
// needs `total_steps` (0: unknown, no ETA).
class Progress {
 public:
  explicit Progress(int every = 50, int64_t total_steps = 0);
  void update(int64_t step, double loss, double scale, int64_t samples);
  void finish();

 private:
  bool terminal_;
  int every_;
  int64_t total_steps_;
  int64_t samples_ = 0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace examples
