// SPDX-License-Identifier: BSD-3-Clause
#include "run_setup.h"

#include <amp/memory.h>
#include <amp/opt_levels.h>

#include <string>

#include <sys/resource.h>

#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <absl/flags/usage.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <unistd.h>

ABSL_FLAG(double, fp8_min_gemm_intensity, -1,
          "with --opt_level=O5+fp8: Options::fp8_scaling.min_gemm_intensity, the multiply-adds per element "
          "quantized a GEMM needs to run in float8 (0: every GEMM that fits; below 0: amp's default)");

namespace examples {

int run_main(int argc, char** argv, const char* usage, const std::function<int()>& run) {
  absl::SetProgramUsageMessage(usage);
  absl::ParseCommandLine(argc, argv);
  const std::string program = std::filesystem::path(argv[0]).filename().string();
  amp::track_allocations();
  try {
    return run();
  } catch (const std::invalid_argument& e) {
    std::cerr << program << ": " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {  // amp's and LibTorch's errors: the message, not C++ frames
    std::cerr << program << ": " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << program << ": " << e.what() << "\n";
    return 1;
  }
}

c10::Device parse_device(const std::string& device) {
  if (device == "cpu") return c10::Device(c10::kCPU);
  if (device == "cuda") {
    if (!torch::cuda::is_available()) {
      throw std::invalid_argument("--device=cuda, but no CUDA GPU is available; use --device=cpu");
    }
    return c10::Device(c10::kCUDA, 0);
  }
  throw std::invalid_argument("--device must be cpu or cuda, got '" + device + "'");
}

amp::Options amp_options(const std::string& opt_level, const std::string& dtype,
                         c10::Device device, int verbosity) {
  amp::Options options;
  try {
    const bool fp8 = opt_level == "O5+fp8";  // O5 with linear layers' GEMMs in float8
    options = amp::Options(fp8 ? std::string("O5") : opt_level);
    if (fp8) options.fp8 = true;
    const double least = absl::GetFlag(FLAGS_fp8_min_gemm_intensity);
    if (fp8 && least >= 0) options.fp8_scaling.min_gemm_intensity = least;
  } catch (const c10::Error& e) {
    throw std::invalid_argument("--opt_level: " + std::string(e.what_without_backtrace()));
  }
  options.verbosity = verbosity;
  if (dtype.empty()) return options;
  c10::ScalarType low;
  if (dtype == "fp16") {
    low = c10::kHalf;
  } else if (dtype == "bf16") {
    low = c10::kBFloat16;
  } else {
    throw std::invalid_argument("--dtype must be fp16 or bf16, got '" + dtype + "'");
  }
  if (options.opt_level == amp::O4 || options.opt_level == amp::O5 || options.opt_level == amp::O6) {
    if (low != c10::kBFloat16) throw std::invalid_argument("--opt_level O4/O5/O6 are bf16 levels; drop --dtype=fp16");
    return options;
  }
  (device.is_cuda() ? options.cuda_dtype : options.cpu_dtype) = low;
  return options;
}

std::string level_name(const amp::Options& options) {
  return std::string(amp::to_string(options.opt_level)) + (options.fp8.value_or(false) ? "+fp8" : "");
}

bool use_fused_optimizer(const std::string& flag, const amp::Options& options, bool cuda_graph) {
  if (flag == "fused") return true;
  if (flag == "libtorch") return false;
  // Where only amp's fused optimizers apply: a graphed step, O6's rounding, 8-bit state, the step in backward.
  if (flag.empty()) {
    return cuda_graph || (options.opt_level == amp::O6 && options.stochastic_rounding.value_or(true)) ||
           options.optimizer_state_dtype == c10::kByte || options.step_in_backward.value_or(false);
  }
  throw std::invalid_argument("--optimizer must be fused or libtorch, got '" + flag + "'");
}

double peak_allocated_mib(c10::Device device) { return amp::allocated_bytes(device).peak / 1048576.0; }

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

Progress::Progress(int every, int64_t total_steps)
    : terminal_(isatty(fileno(stdout)) != 0),
      every_(every),
      total_steps_(total_steps),
      start_(std::chrono::steady_clock::now()) {}

void Progress::update(int64_t step, double loss, double scale, int64_t samples) {
  samples_ += samples;
  if (!terminal_ && step % every_ != 0) return;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::string of_total, eta;
  if (total_steps_ > 0) {
    of_total = "/" + std::to_string(total_steps_);
    const int left = static_cast<int>(seconds / step * static_cast<double>(total_steps_ - step) + 0.5);
    char text[32];
    std::snprintf(text, sizeof text, "  ETA %d:%02d", left / 60, left % 60);
    eta = text;
  }
  std::printf("%sstep %6lld%s  loss %.4f  scale %-9g %8.0f samples/s%s%s", terminal_ ? "\r" : "",
              static_cast<long long>(step), of_total.c_str(), loss, scale,
              samples_ / std::max(seconds, 1e-9), eta.c_str(), terminal_ ? "" : "\n");
  std::fflush(stdout);
}

void Progress::finish() {
  if (terminal_) std::printf("\n");
}

}  // namespace examples
