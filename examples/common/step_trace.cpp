// SPDX-License-Identifier: BSD-3-Clause
#include "common/step_trace.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdio>
#include <set>
#include <utility>

namespace examples {
namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;

std::set<ActivityType> activities(c10::Device device) {
  std::set<ActivityType> out{ActivityType::CPU};
  if (device.is_cuda()) out.insert(ActivityType::CUDA);
  return out;
}

}  // namespace

StepTrace::StepTrace(std::string path, c10::Device device, int64_t first_step, int64_t steps)
    : path_(std::move(path)), device_(device), first_(first_step), last_(first_step + steps - 1) {}

StepTrace::~StepTrace() {
  if (running_) stop();
}

void StepTrace::at_step(int64_t step) {
  if (path_.empty()) return;
  if (step == first_ && !running_) {
    const profiler::ProfilerConfig config(profiler::ProfilerState::KINETO, /*report_input_shapes=*/true,
                                          /*profile_memory=*/false);
    profiler::prepareProfiler(config, activities(device_));
    profiler::enableProfiler(config, activities(device_));
    running_ = true;
  } else if (step == last_ + 1 && running_) {
    stop();
  }
}

void StepTrace::stop() {
  running_ = false;
  const std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  result->save(path_);
  std::printf("trace of steps %lld-%lld written to %s\n", static_cast<long long>(first_),
              static_cast<long long>(last_), path_.c_str());
}

}  // namespace examples
