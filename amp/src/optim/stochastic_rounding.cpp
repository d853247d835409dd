// SPDX-License-Identifier: BSD-3-Clause
#include "optim/stochastic_rounding.h"

#include "optim/one_pass_kernels.h"
#include "optim/widened_step_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <limits>

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

// A CUDA device's name with its index ("cuda:0"): its generator's key.
std::string device_key(c10::Device device) {
  return "cuda:" + std::to_string(device.has_index() ? device.index() : 0);
}

// Values rounded a task at a time on ATen's threads (a multiple of 8: a
// task's draws start at a counter's first).
constexpr int64_t kRoundedPerTask = 1 << 14;

}  // namespace

int64_t StochasticRounding::next_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  return ++steps_;
}

uint64_t StochasticRounding::stream_seed_locked(RoundingKey key) const {
  // A first slice draws what the whole tensor drew before tensors were sliced.
  const uint64_t tensor = key.part == 0 ? mix(key.tensor) : mix(key.tensor ^ mix(key.part));
  return mix(seed_ ^ mix(stream_ ^ mix(static_cast<uint64_t>(key.step) ^ tensor)));
}

uint64_t StochasticRounding::stream_seed(RoundingKey key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stream_seed_locked(key);
}

at::Generator StochasticRounding::seeded(c10::Device device, RoundingKey key) {
  TORCH_INTERNAL_ASSERT(device.is_cuda());
  const std::string name = device_key(device);
  auto it = generators_.find(name);
  if (it == generators_.end()) {
    it = generators_.emplace(name, at::globalContext().defaultGenerator(c10::Device(name)).clone()).first;
  }
  at::Generator& g = it->second;
  std::lock_guard<std::mutex> g_lock(g.mutex());
  g.set_current_seed(stream_seed_locked(key));
  g.set_offset(0);
  return g;
}

at::Tensor StochasticRounding::cpu_draws(uint64_t seed, int64_t numel) {
  at::Tensor draws = at::empty({numel}, at::kInt);
  auto* out = reinterpret_cast<uint32_t*>(draws.mutable_data_ptr<int32_t>());
  at::philox_engine engine(seed);
  for (int64_t i = 0; i < numel; ++i) out[i] = engine();
  return draws;
}

void StochasticRounding::round_into(const at::Tensor& src, const at::Tensor& dst, RoundingKey key, CpuPath path) {
  TORCH_INTERNAL_ASSERT(src.scalar_type() == at::kFloat && dst.scalar_type() == at::kBFloat16 &&
                        src.sizes() == dst.sizes());
  const int64_t numel = src.numel();
  if (path == CpuPath::kOnePass && src.is_cpu() && dst.is_contiguous()) {
    const at::Tensor values = src.contiguous();
    const auto* in = reinterpret_cast<const uint32_t*>(values.const_data_ptr<float>());
    auto* out = reinterpret_cast<uint16_t*>(dst.mutable_data_ptr<at::BFloat16>());
    const uint64_t seed = stream_seed(key);
    const RoundFn round = one_pass_kernels().round_to_bfloat16;
    at::parallel_for(0, (numel + kRoundedPerTask - 1) / kRoundedPerTask, 1, [&](int64_t first, int64_t last) {
      const int64_t begin = first * kRoundedPerTask, end = std::min(last * kRoundedPerTask, numel);
      round(in, out, begin, end - begin, seed);
    });
    return;
  }
  at::Tensor noise;
  if (src.is_cpu()) {
    // 16 bits a value, two from a draw (one_pass_kernels.h).
    noise = cpu_draws(stream_seed(key), (numel + 1) / 2)
                .view(at::kShort)
                .narrow(0, 0, numel)
                .to(at::kInt)
                .bitwise_and_(0xFFFF)
                .view(src.sizes());
  } else {
    std::lock_guard<std::mutex> lock(mutex_);
    noise = at::randint(0, 1 << 16, src.sizes(), seeded(src.device(), key), src.options().dtype(at::kInt));
  }
  const at::Tensor bits = src.contiguous().view(at::kInt).add(noise).bitwise_and_(kKeptBits);
  // Exact: the cut bits are zero. A NaN's bits plus noise may carry into
  // inf, or past the sign into a small number: NaN stays NaN.
  dst.copy_(bits.view(at::kFloat).masked_fill_(src.isnan(), std::numeric_limits<float>::quiet_NaN()));
}

void StochasticRounding::round_all(const std::vector<Rounding>& roundings, CpuPath path) {
  std::vector<CudaRounding> on_cuda;
  for (const Rounding& r : roundings) {
#ifdef AMP_WITH_CUDA_KERNELS
    if (path == CpuPath::kOnePass && r.dst.is_contiguous() && widened_step_kernels_apply(r.src) &&
        (on_cuda.empty() || on_cuda.front().src.device() == r.src.device())) {
      on_cuda.push_back({r.src.contiguous(), r.dst, stream_seed(r.key)});
      continue;
    }
#endif
    round_into(r.src, r.dst, r.key, path);
  }
#ifdef AMP_WITH_CUDA_KERNELS
  if (!on_cuda.empty()) round_on_cuda(on_cuda);
#endif
}

at::Tensor StochasticRounding::uniform(at::IntArrayRef sizes, c10::Device device, RoundingKey key) {
  if (device.is_cpu()) {  // at::rand's float of a draw: its low 24 bits over 2^24
    return cpu_draws(stream_seed(key), c10::multiply_integers(sizes))
        .bitwise_and_(0xFFFFFF)
        .to(at::kFloat)
        .mul_(1.0 / (1 << 24))
        .view(sizes);
  }
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
