// SPDX-License-Identifier: BSD-3-Clause
// Private: one operand's float8 scaling at one GEMM site - Transformer
// Engine's FP8 meta (a scale and an amax history), kept on the device.
// The recipe and its formula: Options::Fp8Scaling (options.h).
#pragma once

#include "fp8/fp8_quantize.h"

#include <amp/options.h>

#include <ATen/core/Tensor.h>
#include <torch/serialize/archive.h>

#include <string>
#include <tuple>
#include <vector>

#include <utility>

namespace amp::detail {

// What one operand's quantizations held over an iteration (with
// Options::precision_telemetry): device tensors, read only when asked.
struct Fp8Tally {
  int64_t calls = 0, numel = 0;
  at::Tensor counts;  // int64 [2]: saturated, flushed to zero
  at::Tensor amax;    // float32 [1]: the largest |x|
  at::Tensor scale;   // float32 [1]: the scale of the latest call
};

// m.t().contiguous() of a float8 matrix; on CUDA one tiled pass.
at::Tensor fp8_transposed(const at::Tensor& m);

class Fp8Scaler {
 public:
  // `format`: at::kFloat8_e4m3fn or at::kFloat8_e5m2. `tally`: keep an
  // Fp8Tally of every iteration.
  Fp8Scaler(const Options::Fp8Scaling& recipe, at::ScalarType format, bool tally = false);

  // `x` multiplied by the scale, saturated to +-fp8_max and rounded to the
  // format, and the inverse scale (a 0-dim float32 tensor) the GEMM applies.
  // Records x's amax for the next update (the largest of the iteration's
  // calls). An x holding an inf or NaN gets a NaN inverse scale, so the
  // GEMM's product is not finite and the loss scaler sees the overflow that
  // saturation would hide; its amax stays out of the history. No host sync.
  // `tally`: false for a recomputed block's rerun, which quantizes again
  // what its forward already counted.
  // On CUDA (where the build has the kernels) two fused kernels do it
  // (fp8_quantize.h); quantize_reference() is the same in ATen ops, every
  // device, and the reference those kernels are tested against.
  std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& x, bool tally = true);
  std::pair<at::Tensor, at::Tensor> quantize_reference(const at::Tensor& x, bool tally = true);
  // quantize() of a matrix x [rows, cols], with the values' transpose
  // [cols, rows] contiguous beside them (what _scaled_mm takes as a
  // column-major operand): values, inverse scale, transpose. On CUDA the
  // pass that casts writes both.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_transposed(const at::Tensor& x, bool tally = true);

  // Once an iteration, if quantize() ran since the last update: the tally
  // completes, and with delayed scaling the next scale comes from the
  // history, which then rolls by one. No host sync.
  void update();
  // The same for many scalers of one recipe at once (Fp8Gemms::update):
  // begin_update() does the host's part and says whether the device's is
  // due; update_delayed() does that for all, in one batch of _foreach_ calls.
  bool begin_update();
  static void update_delayed(const std::vector<Fp8Scaler*>& scalers);
  // Counts the updates that changed anything: what a quantization made
  // before a later generation is stale.
  int64_t generation() const { return generation_; }

  // The tally of the latest iteration an update completed (empty before).
  const Fp8Tally& completed_tally() const { return completed_; }

  // amp's state (persistence/state.cpp): the scale, the history and whether
  // an update has set the scale. restore() takes what save() wrote, after
  // check_saved() accepted it; the tensors move to the operand's device at
  // its next quantize.
  void save(torch::serialize::OutputArchive& archive) const;
  void check_saved(torch::serialize::InputArchive& archive, const std::string& what) const;
  void restore(torch::serialize::InputArchive& archive);

  at::ScalarType format() const { return format_; }
  double fp8_max() const { return fp8_max_; }
  // float32 [1]; float32 [amax_history_len], latest first.
  const at::Tensor& scale() const { return scale_; }
  const at::Tensor& amax_history() const { return history_; }

 private:
  // The fused kernels' part (GPU builds): whether they take x, and what
  // they read and write of this scaler, placed on x's device.
  bool fused_applies(const at::Tensor& x, bool tally) const;
  Fp8QuantizeState fused_state(const at::Tensor& x);
  double scale_factor() const;
  at::Tensor fresh_scale(const at::Tensor& amax) const;
  void place(const at::Tensor& like);
  void adopt(at::Tensor scale, at::Tensor history, at::Tensor updated);
  void add_to_tally(const at::Tensor& x, const at::Tensor& x8, const at::Tensor& saturated, const at::Tensor& amax,
                    const at::Tensor& scale);

  Options::Fp8Scaling recipe_;
  at::ScalarType format_;
  double fp8_max_;
  at::Tensor scale_;    // the delayed scale
  at::Tensor history_;  // [0]: this iteration's amax so far
  at::Tensor updated_;  // float32 [1]: 1 once an update set scale_ from a history
  at::Tensor current_;  // history_[0], a view
  at::Tensor spare_;    // where an update assembles the rolled history
  bool dirty_ = false;  // quantize() ran since the last update
  int64_t generation_ = 0;
  bool tallying_;
  Fp8Tally tally_, completed_;
};

}  // namespace amp::detail
