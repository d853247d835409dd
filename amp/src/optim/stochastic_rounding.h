// SPDX-License-Identifier: BSD-3-Clause
// Private: rounding float32 values into bfloat16 stochastically (O6).
//
// A float32 value lies between two bfloat16 values a and b (a < b); it
// becomes b with probability (x - a) / (b - a), else a, so its expectation
// is x: updates smaller than half a bf16 ulp still move a weight on
// average, where rounding to nearest drops them every step. Done on the
// bit pattern, as torchao's bf16_stochastic_round: add 16 uniform random
// bits below bf16's cut to the float32 pattern and truncate them.
//
// The noise comes from streams counted by optimizer step: each tensor a
// step rounds draws from a stream seeded anew from (seed, stream, step,
// the tensor's key and, for a tensor stepped in slices, the slice's), so
// the whole rounding state is two numbers, and what a
// tensor draws does not depend on which tensors were rounded before it (a
// step applied parameter by parameter during backward rounds bit for bit
// as the whole step). On the CPU a stream is Philox4x32-10's
// (one_pass_kernels.h), computed where it is used; on CUDA it is the
// device generator's, seeded with the stream's seed. The seed is the CPU default
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
#include <vector>

namespace amp::detail {

// How a tensor is rounded or coded: by amp's kernels (kOnePass: on the CPU
// in one pass over its values, one_pass_kernels.h; on CUDA, rounding and
// packing, many tensors a launch, widened_step_kernels.h, where the build
// has them), or by the composition of ATen ops that every device runs
// (kAtenOps: the kernels' reference in the tests, and CUDA's path for 8-bit
// state's decoding; drawing on the CPU by ATen's own Philox engine, on CUDA
// by at::randint and at::rand). Both draw the same noise and write the same
// bits; a NaN is written as bfloat16's canonical NaN by the CPU's one-pass
// kernel, and as ATen's vectorized conversion writes it by the ATen ops.
enum class CpuPath { kOnePass, kAtenOps };

// Which stream one rounding draws from: the step's number (next_step) and
// the tensor's key within the step (its parameter's position in the
// optimizer and which of its tensors).
struct RoundingKey {
  int64_t step = 0;
  uint64_t tensor = 0;
  uint64_t part = 0;  // the slice of a tensor stepped in slices (0: the first, or the whole tensor)
};

class StochasticRounding {
 public:
  // `weights`: the session rounds weights (O6), not only 8-bit optimizer
  // state; it names the entry in amp's state.
  StochasticRounding(uint64_t seed, uint64_t stream, bool weights = true)
      : seed_(seed), stream_(stream), weights_(weights) {}

  // An optimizer step begins: returns its number, which its roundings'
  // keys carry.
  int64_t next_step();
  // dst (bfloat16) = src (float32, same shape and device), rounded.
  void round_into(const at::Tensor& src, const at::Tensor& dst, RoundingKey key,
                  CpuPath path = CpuPath::kOnePass);
  // One rounding of round_all.
  struct Rounding {
    at::Tensor src, dst;
    RoundingKey key;
  };
  // Each of `roundings` as round_into rounds it; on CUDA those the kernel
  // takes (widened_step_kernels.h) in one launch per few dozen tensors.
  void round_all(const std::vector<Rounding>& roundings, CpuPath path = CpuPath::kOnePass);
  // Uniform float32 noise in [0, 1) of `sizes` on `device` (8-bit
  // optimizer state's rounding: eight_bit_state.h), as at::rand makes a
  // float of each 32-bit draw.
  at::Tensor uniform(at::IntArrayRef sizes, c10::Device device, RoundingKey key);
  // The seed of `key`'s stream.
  uint64_t stream_seed(RoundingKey key) const;
  // The first `numel` draws of the CPU stream seeded `seed` (int32 bits),
  // by ATen's at::philox_engine: the one-pass kernels' reference.
  static at::Tensor cpu_draws(uint64_t seed, int64_t numel);

  // Entry "stochastic_rounding" (rounding weights) or "state_rounding"
  // (8-bit state only): the seed and the steps taken.
  void save(torch::serialize::OutputArchive& archive) const;
  // Reads either entry. Errors (nothing changes): an entry that is not two
  // int64 values.
  void load(torch::serialize::InputArchive& archive);
  static bool is_entry(const std::string& key);
  // Whether `key` is the entry of a session that rounds weights: a run
  // without rounding cannot continue it (8-bit state's entry it can drop,
  // keeping its state in float32).
  static bool is_weights_entry(const std::string& key);

 private:
  // The CUDA device's generator seeded for `key`; mutex_ held.
  at::Generator seeded(c10::Device device, RoundingKey key);
  uint64_t stream_seed_locked(RoundingKey key) const;

  mutable std::mutex mutex_;  // held from seeding a CUDA generator to its draw
  uint64_t seed_, stream_;
  bool weights_;
  int64_t steps_ = 0;
  std::map<std::string, at::Generator> generators_;  // by CUDA device ("cuda:0")
};

}  // namespace amp::detail
