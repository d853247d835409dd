#include "step/stochastic_rounding.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <vector>

namespace amp::detail {
namespace {

constexpr const char* kPrefix = "stochastic_rounding.";
constexpr int32_t kKeptBits = static_cast<int32_t>(0xFFFF0000u);  // sign, exponent, bf16's 7 mantissa bits

std::string device_key(c10::Device device) {
  return device.is_cuda() ? "cuda:" + std::to_string(device.has_index() ? device.index() : 0) : "cpu";
}

c10::Device device_of(const std::string& key) { return c10::Device(key); }

}  // namespace

at::Generator StochasticRounding::generator(c10::Device device) {
  const std::string key = device_key(device);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = generators_.find(key);
  if (it != generators_.end()) return it->second;
  at::Generator g = device.is_cpu() ? at::make_generator<at::CPUGeneratorImpl>(seed_)
                                    : at::globalContext().defaultGenerator(device_of(key)).clone();
  if (!device.is_cpu()) {
    std::lock_guard<std::mutex> g_lock(g.mutex());
    g.set_current_seed(seed_);
    g.set_offset(0);
  }
  return generators_.emplace(key, g).first->second;
}

void StochasticRounding::round_into(const at::Tensor& src, const at::Tensor& dst) {
  TORCH_INTERNAL_ASSERT(src.scalar_type() == at::kFloat && dst.scalar_type() == at::kBFloat16 &&
                        src.sizes() == dst.sizes());
  const at::Tensor noise = at::randint(0, 1 << 16, src.sizes(), generator(src.device()),
                                       src.options().dtype(at::kInt));
  const at::Tensor bits = src.contiguous().view(at::kInt).add(noise).bitwise_and_(kKeptBits);
  dst.copy_(bits.view(at::kFloat));  // exact: the cut bits are zero
}

void StochasticRounding::save(torch::serialize::OutputArchive& archive) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [key, g] : generators_) {
    at::Generator copy = g;
    std::lock_guard<std::mutex> g_lock(copy.mutex());
    archive.write(kPrefix + key, copy.get_state());
  }
}

bool StochasticRounding::is_entry(const std::string& key) { return key.rfind(kPrefix, 0) == 0; }

void StochasticRounding::load(torch::serialize::InputArchive& archive) {
  std::vector<std::pair<c10::Device, at::Tensor>> states;
  for (const std::string& key : archive.keys()) {
    if (!is_entry(key)) continue;
    const std::string device = key.substr(std::string(kPrefix).size());
    TORCH_CHECK(device == "cpu" || device.rfind("cuda:", 0) == 0, "amp: entry '", key, "' names no device "
                "amp rounds on.");
    at::Tensor state;
    archive.read(key, state);
    TORCH_CHECK(state.scalar_type() == at::kByte && state.dim() == 1, "amp: entry '", key, "' should hold a "
                "generator's state (a 1-D uint8 tensor), got ", state.scalar_type(), " of shape ", state.sizes());
    states.emplace_back(device_of(device), state);
  }
  // Checked on copies first: a state the generator refuses changes nothing.
  std::vector<std::pair<at::Generator, at::Tensor>> checked;
  for (const auto& [device, state] : states) {
    at::Generator copy = generator(device).clone();
    std::lock_guard<std::mutex> lock(copy.mutex());
    copy.set_state(state);
    checked.emplace_back(generator(device), state);
  }
  for (auto& [g, state] : checked) {
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }
}

}  // namespace amp::detail
