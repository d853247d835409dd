// SPDX-License-Identifier: BSD-3-Clause
// Runs code under LibTorch's profiler (the CPU, with input shapes) and
// returns the events it recorded: what a user's trace would show.
#pragma once

#include <torch/csrc/autograd/profiler_kineto.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

namespace amp::testing {

inline std::vector<torch::autograd::profiler::KinetoEvent> profiled(const std::function<void()>& fn) {
  namespace profiler = torch::autograd::profiler;
  const profiler::ProfilerConfig config(profiler::ProfilerState::KINETO, /*report_input_shapes=*/true,
                                        /*profile_memory=*/false);
  const std::set<torch::profiler::impl::ActivityType> cpu{torch::profiler::impl::ActivityType::CPU};
  profiler::prepareProfiler(config, cpu);
  profiler::enableProfiler(config, cpu);
  try {
    fn();
  } catch (...) {
    profiler::disableProfiler();
    throw;
  }
  return profiler::disableProfiler()->events();
}

// The names of amp's ranges among `events`, each as often as recorded.
inline std::multiset<std::string> amp_ranges(const std::vector<torch::autograd::profiler::KinetoEvent>& events) {
  std::multiset<std::string> names;
  for (const auto& e : events) {
    if (e.name().rfind("amp::", 0) == 0) names.insert(e.name());
  }
  return names;
}

}  // namespace amp::testing
