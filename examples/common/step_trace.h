// SPDX-License-Identifier: BSD-3-Clause
// --trace=FILE: a Chrome trace (chrome://tracing, ui.perfetto.dev) of a few
// training steps from LibTorch's profiler, with input shapes, where amp's
// own work shows under amp's names (docs/guide.md, "amp in a profiler
// trace"). Steps 3 to 5 by default: after the first steps' one-time work.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace examples {

class StepTrace {
 public:
  // An empty `path` traces nothing.
  StepTrace(std::string path, c10::Device device, int64_t first_step = 3, int64_t steps = 3);
  ~StepTrace();  // writes the trace if the run ended inside its steps
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;

  // Call at the start of each training step (counted from 1).
  void at_step(int64_t step);

 private:
  void stop();

  std::string path_;
  c10::Device device_;
  int64_t first_, last_;
  bool running_ = false;
};

}  // namespace examples
