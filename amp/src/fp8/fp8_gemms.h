// Private: the fp8 property's state - one Fp8Site per linear layer (by its
// weight), created by the layer's first forward, and their update once an
// iteration (the step participant in step/fp8_step.h calls it when a guard
// commits). GEMMs whose shapes the device cannot take in float8 run in
// bfloat16 and are counted.
#pragma once

#include "fp8/fp8_linear.h"

#include <c10/core/TensorImpl.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace amp::detail {

class Fp8Gemms {
 public:
  explicit Fp8Gemms(const Options::Fp8Scaling& recipe);

  // at::linear for the interception kernel, the site being `layer`'s (its
  // weight parameter): in float8 when the shapes fit (fp8_linear.h), else
  // at::linear as given (counted).
  at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                    const c10::TensorImpl* layer);

  // Delayed scaling: every site's next scales. No host sync.
  void update();

  // amp's state: every site under its weight's parameter name, in the
  // archive entry "fp8". load() checks everything before it changes
  // anything. Errors: a name `names` does not know; a malformed entry; an
  // amax history of another length than the recipe's.
  using Names = std::unordered_map<const c10::TensorImpl*, std::string>;
  void save(torch::serialize::OutputArchive& archive, const Names& names) const;
  void load(torch::serialize::InputArchive& archive, const Names& names);
  static bool is_entry(const std::string& key) { return key == "fp8"; }

  int64_t sites() const;
  int64_t fallbacks() const;
  // The site of the layer whose weight parameter is `weight`, or null before
  // its first forward.
  std::shared_ptr<Fp8Site> site_of(const at::Tensor& weight) const;

 private:
  Options::Fp8Scaling recipe_;
  at::ScalarType forward_, backward_;
  mutable std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, std::shared_ptr<Fp8Site>> sites_;
  int64_t fallbacks_ = 0;
};

}  // namespace amp::detail
