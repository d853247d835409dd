// Private: rounding float32 values into bfloat16 stochastically (O6).
//
// A float32 value lies between two bfloat16 values a and b (a < b); it
// becomes b with probability (x - a) / (b - a), else a, so its expectation
// is x: updates smaller than half a bf16 ulp still move a weight on
// average, where rounding to nearest drops them every step. Done on the
// bit pattern, as torchao's bf16_stochastic_round: add 16 uniform random
// bits below bf16's cut to the float32 pattern and truncate them.
//
// The noise comes from streams counted by optimizer step: at each step the
// generator of each device is seeded anew from (seed, stream, step), so the
// whole rounding state is two numbers. The seed is the CPU default
// generator's at initialize (torch::manual_seed; rank 0's under
// data_parallel), so runs are reproducible and the program's own random
// streams (dropout, data) are the same with and without O6. Replicas draw
// the same stream and stay identical; sharded ranks, which round different
// elements, each draw their own. The counts travel in amp's state
// (state.h), so a resumed run rounds as the uninterrupted one, on every
// rank.
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
  StochasticRounding(uint64_t seed, uint64_t stream) : seed_(seed), stream_(stream) {}

  // An optimizer step begins: its roundings draw from the step's streams.
  void next_step();
  // dst (bfloat16) = src (float32, same shape and device), rounded.
  void round_into(const at::Tensor& src, const at::Tensor& dst);

  // Entry "stochastic_rounding": the seed and the steps taken.
  void save(torch::serialize::OutputArchive& archive) const;
  // Errors (nothing changes): an entry that is not two int64 values.
  void load(torch::serialize::InputArchive& archive);
  static bool is_entry(const std::string& key);

 private:
  at::Generator generator(c10::Device device);

  mutable std::mutex mutex_;
  uint64_t seed_, stream_;
  int64_t steps_ = 0;
  // By device ("cpu", "cuda:0"): its generator and the step it was seeded for.
  std::map<std::string, std::pair<at::Generator, int64_t>> generators_;
};

}  // namespace amp::detail
