// Private: rounding float32 values into bfloat16 stochastically (O6).
//
// A float32 value lies between two bfloat16 values a and b (a < b); it
// becomes b with probability (x - a) / (b - a), else a, so its expectation
// is x: updates smaller than half a bf16 ulp still move a weight on
// average, where rounding to nearest drops them every step. Done on the
// bit pattern, as torchao's bf16_stochastic_round: add 16 uniform random
// bits below bf16's cut to the float32 pattern and truncate them.
//
// Each device draws from a generator of amp's own, seeded at initialize
// from the CPU default generator's seed (torch::manual_seed), so runs are
// reproducible and the program's own random streams (dropout, data) are
// the same with and without O6. Their states travel in amp's state
// (state.h), so a resumed run rounds as the uninterrupted one.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace amp::detail {

class StochasticRounding {
 public:
  explicit StochasticRounding(uint64_t seed) : seed_(seed) {}

  // dst (bfloat16) = src (float32, same shape and device), rounded.
  void round_into(const at::Tensor& src, const at::Tensor& dst);

  // Entries "stochastic_rounding.<device>" holding each generator's state.
  void save(torch::serialize::OutputArchive& archive) const;
  // Errors (nothing changes): an entry that is no generator state.
  void load(torch::serialize::InputArchive& archive);
  static bool is_entry(const std::string& key);

 private:
  at::Generator generator(c10::Device device);

  uint64_t seed_;
  mutable std::mutex mutex_;
  std::map<std::string, at::Generator> generators_;  // by device, "cpu", "cuda:0"
};

}  // namespace amp::detail
