// SPDX-License-Identifier: BSD-3-Clause
#include "recompute/forward_replay.h"

#include "interception/dispatch/cast.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/GradMode.h>

#include <mutex>
#include <set>

namespace amp::detail {
namespace {

// The generators a block may draw from: the CPU's, and each CUDA device's
// among `inputs` (as Python's checkpoint preserves).
std::vector<at::Generator> generators_of(const std::vector<at::Tensor>& inputs) {
  std::vector<at::Generator> out{at::globalContext().defaultGenerator(c10::Device(c10::kCPU))};
  std::set<c10::DeviceIndex> cuda;
  for (const at::Tensor& t : inputs) {
    if (t.defined() && t.is_cuda()) cuda.insert(t.device().index());
  }
  for (c10::DeviceIndex i : cuda) out.push_back(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, i)));
  return out;
}

at::Tensor state_of(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_state(at::Generator& generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

}  // namespace

ForwardReplay::ForwardReplay(const std::vector<at::Tensor>& inputs)
    : keys_(c10::impl::tls_local_dispatch_key_set()),
      cpu_dtype_(at::autocast::get_autocast_dtype(c10::DeviceType::CPU)),
      cuda_dtype_(at::autocast::get_autocast_dtype(c10::DeviceType::CUDA)),
      cache_enabled_(at::autocast::is_autocast_cache_enabled()) {
  for (at::Generator& g : generators_of(inputs)) generators_.push_back({g, state_of(g)});
}

void ForwardReplay::keep_updated_buffers(const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                                         const std::vector<int64_t>& versions) {
  static const std::string kTracked = "num_batches_tracked";
  std::vector<std::string> normalized;  // module prefixes ("layer1.bn.") whose statistics moved
  for (size_t i = 0; i < buffers.size(); ++i) {
    const auto& [name, tensor] = buffers[i];
    if (tensor._version() == versions[i]) continue;
    updated_buffers_.push_back(tensor);
    if (name.size() >= kTracked.size() && name.compare(name.size() - kTracked.size(), kTracked.size(), kTracked) == 0) {
      normalized.push_back(name.substr(0, name.size() - kTracked.size()));
    }
  }
  for (const std::string& prefix : normalized) {
    for (size_t i = 0; i < buffers.size(); ++i) {
      const auto& [name, tensor] = buffers[i];
      if (tensor._version() != versions[i]) continue;  // kept already
      if (name == prefix + "running_mean" || name == prefix + "running_var") updated_buffers_.push_back(tensor);
    }
  }
}

ForwardReplay::Scope::Scope(const ForwardReplay& replay, const std::vector<at::Tensor>& proxies)
    : keys_(replay.keys_),
      cpu_dtype_(at::autocast::get_autocast_dtype(c10::DeviceType::CPU)),
      cuda_dtype_(at::autocast::get_autocast_dtype(c10::DeviceType::CUDA)),
      cache_enabled_(at::autocast::is_autocast_cache_enabled()),
      replay_(replay) {
  at::NoGradGuard no_grad;
  for (const at::Tensor& b : replay.updated_buffers_) buffer_values_.push_back(b.clone());
  for (const GeneratorState& g : replay.generators_) {
    at::Generator generator = g.generator;
    generators_.push_back({generator, state_of(generator)});
    set_state(generator, g.state);
  }
  at::autocast::set_autocast_dtype(c10::DeviceType::CPU, replay.cpu_dtype_);
  at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, replay.cuda_dtype_);
  at::autocast::set_autocast_cache_enabled(replay.cache_enabled_);
  serve_.emplace(replay.copies_, proxies);
  set_recomputing(true);
}

ForwardReplay::Scope::~Scope() {
  set_recomputing(false);
  serve_.reset();
  at::autocast::set_autocast_cache_enabled(cache_enabled_);
  at::autocast::set_autocast_dtype(c10::DeviceType::CUDA, cuda_dtype_);
  at::autocast::set_autocast_dtype(c10::DeviceType::CPU, cpu_dtype_);
  for (GeneratorState& g : generators_) set_state(g.generator, g.state);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < buffer_values_.size(); ++i) {
    replay_.updated_buffers_[i].variable_data().copy_(buffer_values_[i]);  // the counter stays
  }
}

}  // namespace amp::detail
