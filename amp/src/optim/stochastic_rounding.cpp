// SPDX-License-Identifier: BSD-3-Clause
#include "optim/stochastic_rounding.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <vector>

namespace amp::detail {
namespace {

constexpr const char* kEntry = "stochastic_rounding";
constexpr const char* kStateEntry = "state_rounding";
constexpr int32_t kKeptBits = static_cast<int32_t>(0xFFFF0000u);  // sign, exponent, bf16's 7 mantissa bits

// SplitMix64's finalizer: neighbouring inputs give unrelated seeds.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::string device_key(c10::Device device) {
  return device.is_cuda() ? "cuda:" + std::to_string(device.has_index() ? device.index() : 0) : "cpu";
}

// What the ATen ops below compute, in one pass: each value's bits plus one
// draw's low 16 bits (at::randint(0, 2^16) draws random() % 2^16), cut to
// bfloat16's. The cut bits are zero, so the narrowing is the shift. Serial,
// as ATen's draws are: the draws are one stream in order.
void round_in_one_pass(const at::Tensor& src, const at::Tensor& dst, at::mt19937 engine) {
  const auto* in = reinterpret_cast<const uint32_t*>(src.const_data_ptr<float>());
  auto* out = reinterpret_cast<uint16_t*>(dst.mutable_data_ptr<at::BFloat16>());
  constexpr uint16_t kNaN = 0x7FC0;
  constexpr uint32_t kExponentBits = 0x7F800000u, kMantissaBits = 0x007FFFFFu;
  for (int64_t i = 0, n = src.numel(); i < n; ++i) {
    const uint32_t bits = (in[i] + (engine() & 0xFFFFu)) & static_cast<uint32_t>(kKeptBits);
    const bool nan = (bits & kExponentBits) == kExponentBits && (bits & kMantissaBits) != 0;
    out[i] = nan ? kNaN : static_cast<uint16_t>(bits >> 16);
  }
}

}  // namespace

int64_t StochasticRounding::next_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  return ++steps_;
}

at::Generator StochasticRounding::seeded(c10::Device device, RoundingKey key) {
  const std::string name = device_key(device);
  auto it = generators_.find(name);
  if (it == generators_.end()) {
    at::Generator g = device.is_cpu() ? at::make_generator<at::CPUGeneratorImpl>()
                                      : at::globalContext().defaultGenerator(c10::Device(name)).clone();
    it = generators_.emplace(name, g).first;
  }
  at::Generator& g = it->second;
  std::lock_guard<std::mutex> g_lock(g.mutex());
  // A first slice draws what the whole tensor drew before tensors were sliced.
  const uint64_t tensor = key.part == 0 ? mix(key.tensor) : mix(key.tensor ^ mix(key.part));
  g.set_current_seed(mix(seed_ ^ mix(stream_ ^ mix(static_cast<uint64_t>(key.step) ^ tensor))));
  if (!device.is_cpu()) g.set_offset(0);
  return g;
}

at::mt19937 StochasticRounding::cpu_engine(RoundingKey key) {
  std::lock_guard<std::mutex> lock(mutex_);
  at::Generator g = seeded(c10::Device(c10::kCPU), key);
  std::lock_guard<std::mutex> g_lock(g.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(g)->engine();
}

void StochasticRounding::round_into(const at::Tensor& src, const at::Tensor& dst, RoundingKey key, CpuPath path) {
  TORCH_INTERNAL_ASSERT(src.scalar_type() == at::kFloat && dst.scalar_type() == at::kBFloat16 &&
                        src.sizes() == dst.sizes());
  if (path == CpuPath::kOnePass && src.is_cpu() && dst.is_contiguous()) {
    round_in_one_pass(src.contiguous(), dst, cpu_engine(key));
    return;
  }
  at::Tensor noise;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    noise = at::randint(0, 1 << 16, src.sizes(), seeded(src.device(), key), src.options().dtype(at::kInt));
  }
  const at::Tensor bits = src.contiguous().view(at::kInt).add(noise).bitwise_and_(kKeptBits);
  dst.copy_(bits.view(at::kFloat));  // exact: the cut bits are zero
}

at::Tensor StochasticRounding::uniform(at::IntArrayRef sizes, c10::Device device, RoundingKey key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return at::rand(sizes, seeded(device, key), at::TensorOptions().dtype(at::kFloat).device(device));
}

void StochasticRounding::save(torch::serialize::OutputArchive& archive) const {
  std::lock_guard<std::mutex> lock(mutex_);
  archive.write(weights_ ? kEntry : kStateEntry, at::tensor({static_cast<int64_t>(seed_), steps_}, at::kLong));
}

bool StochasticRounding::is_entry(const std::string& key) { return key == kEntry || key == kStateEntry; }

bool StochasticRounding::is_weights_entry(const std::string& key) { return key == kEntry; }

void StochasticRounding::load(torch::serialize::InputArchive& archive) {
  at::Tensor state;
  const char* entry = kEntry;
  if (!archive.try_read(entry, state) && !archive.try_read(entry = kStateEntry, state)) return;
  TORCH_CHECK(state.scalar_type() == at::kLong && state.dim() == 1 && state.numel() == 2 && state[1].item<int64_t>() >= 0,
              "amp: entry '", entry, "' should hold the rounding's seed and step count (two int64 "
              "values, the count >= 0), got ", state.scalar_type(), " of shape ", state.sizes());
  std::lock_guard<std::mutex> lock(mutex_);
  seed_ = static_cast<uint64_t>(state[0].item<int64_t>());
  steps_ = state[1].item<int64_t>();
}

}  // namespace amp::detail
