// SPDX-License-Identifier: BSD-3-Clause
// Private: the fp8 property's state - one Fp8Site per linear layer (by its
// weight), created by the layer's first forward, and their update once an
// iteration (the step participant in step/fp8_step.h calls it when a guard
// commits). Which GEMMs run in float8 is choose()'s: those whose shapes the
// device's kernel takes and whose intensity pays (min_gemm_intensity); the
// others run in bfloat16, counted (OpStats::float8_fallbacks) and named
// (amp::fp8_choices).
#pragma once

#include <amp/telemetry.h>

#include "fp8/fp8_linear.h"

#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>
#include <unordered_map>

namespace amp::detail {

class Fp8Gemms {
 public:
  using Names = std::unordered_map<const c10::TensorImpl*, std::string>;

  // `tally`: keep what each operand's quantizations held
  // (Options::precision_telemetry).
  Fp8Gemms(const Options::Fp8Scaling& recipe, bool tally);

  // Whether the interception kernel runs a qualifying GEMM of `layer` (its
  // weight parameter) on `input` with `out` outputs in float8; its figures
  // are kept as the layer's latest choice (choices()).
  bool choose(const at::Tensor& input, int64_t out, const c10::TensorImpl* layer);
  // Each layer's latest choice, named by `names` (others skipped), by name.
  std::vector<Fp8LayerChoice> choices(const Names& names) const;

  // at::linear for the interception kernel in float8 (a chosen GEMM),
  // the site being `layer`'s (its weight parameter); `rerun`: a recomputed
  // block's rerun (fp8_linear).
  at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                    const c10::TensorImpl* layer, bool rerun);

  // When a guard ends an iteration: every operand that ran since the last
  // update completes its tally and takes its next scale. No host sync.
  void update();

  // The completed tallies (amp/telemetry.h), each site named by its
  // weight; one copy to the host. Sites of weights `names` lacks are
  // skipped.
  std::vector<Fp8TensorTelemetry> telemetry(const Names& names) const;

  // amp's state: every site under its weight's parameter name, in the
  // archive entry "fp8". load() checks everything before it changes
  // anything. Errors: a name `names` does not know; a malformed entry; an
  // amax history of another length than the recipe's.
  void save(torch::serialize::OutputArchive& archive, const Names& names) const;
  void load(torch::serialize::InputArchive& archive, const Names& names);
  static bool is_entry(const std::string& key) { return key == "fp8"; }

  // The site of `layer` (its weight parameter), made at its first use.
  std::shared_ptr<Fp8Site> site_for(const c10::TensorImpl* layer);

  int64_t sites() const;
  // The site of the layer whose weight parameter is `weight`, or null before
  // its first forward.
  std::shared_ptr<Fp8Site> site_of(const at::Tensor& weight) const;

 private:
  std::shared_ptr<Fp8Site> make_site() const;

  Options::Fp8Scaling recipe_;
  bool tally_;
  at::ScalarType forward_, backward_;
  mutable std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, std::shared_ptr<Fp8Site>> sites_;
  // A layer's latest choice, as choose() found it.
  struct Choice {
    int64_t rows = 0, in = 0, out = 0;
    double intensity = 0, least = 0;
    bool fits = false;
  };
  std::unordered_map<const c10::TensorImpl*, Choice> choices_;
};

}  // namespace amp::detail
