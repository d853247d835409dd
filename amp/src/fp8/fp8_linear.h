// SPDX-License-Identifier: BSD-3-Clause
// Private: a linear layer's GEMMs in float8 - the forward and both
// gradients through at::_scaled_mm (emulated on the CPU as a float32 GEMM of
// the float8 values), with a scaler per operand (input and
// weight in the forward format, the incoming gradient in the backward
// one). The sites, one per weight, live in Fp8Gemms (fp8_gemms.h).
#pragma once

#include "fp8/fp8_scaler.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace amp::detail {

// One linear layer's scaling.
struct Fp8Site {
  Fp8Site(const Options::Fp8Scaling& recipe, at::ScalarType forward, at::ScalarType backward, bool tally = false)
      : input(recipe, forward, tally), weight(recipe, forward, tally), grad_output(recipe, backward, tally) {}
  Fp8Scaler input, weight, grad_output;

  // The weight quantized, made once while the weight (a parameter: the
  // tensor itself, whatever storage O2/O5 compute it from; a cast of one:
  // its storage), the part of it read (a view's offset, sizes and strides:
  // heads chunked from one table are other values), its version and its
  // scale stay the same: once an iteration, however many calls read it
  // (micro-batches, a recomputed block's rerun, a shared layer).
  std::pair<at::Tensor, at::Tensor> quantized_weight(const at::Tensor& weight);
  int64_t weight_quantizations() const;

 private:
  mutable std::mutex mutex_;
  const void* cached_identity_ = nullptr;
  std::vector<int64_t> cached_geometry_;  // storage offset, sizes, strides
  uint32_t cached_version_ = 0;
  int64_t cached_generation_ = -1;
  at::ScalarType cached_dtype_ = at::kFloat;
  std::pair<at::Tensor, at::Tensor> cached_;
  int64_t quantizations_ = 0;
};

// input [..., in] x weight [out, in]^T (+ bias [out]), as at::linear, in
// float8; the output and the gradients in the dtypes of input, weight and
// bias. Backward: grad_input = grad . weight and grad_weight = grad^T .
// input in float8 from the operands the forward quantized, grad_bias in
// the gradient's dtype. `rerun`: a recomputed block's rerun (its input is
// not tallied again). Errors: a backward with create_graph=true (its float8
// operands have no graph to differentiate).
at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      std::shared_ptr<Fp8Site> site, bool rerun = false);

// An operand in float8 and the inverse of the scale it was quantized with.
struct Fp8Operand {
  at::Tensor values, inverse_scale;
};

// A linear layer's three float8 GEMMs on 2-D operands, as fp8_linear runs
// them, for code that computes a layer's forward and gradients itself
// (amp::linear_cross_entropy, a chunk of tokens at a time); each in `dtype`.
// input [n, in] . weight [out, in]^T -> [n, out]
at::Tensor fp8_forward_gemm(const Fp8Operand& input, const Fp8Operand& weight, at::ScalarType dtype);
// grad [n, out] . weight [out, in] -> [n, in]
at::Tensor fp8_input_gradient_gemm(const Fp8Operand& grad, const Fp8Operand& weight, at::ScalarType dtype);
// grad_t [out, n] (the gradient's transpose, as quantize_transposed writes
// it) . input [n, in] -> [out, in]
at::Tensor fp8_weight_gradient_gemm(const Fp8Operand& grad_t, const Fp8Operand& input, at::ScalarType dtype);

// Whether the device's float8 kernel takes an input [..., in] times a
// weight [out, in]: on CUDA every GEMM of the forward and backward needs
// its inner and outer dimensions multiples of 16 - in, out and the rows of
// the input (the weight gradient's inner dimension); the CPU takes any.
bool fp8_shapes_fit(const at::Tensor& input, int64_t out_features);

// Why `device` cannot run float8 GEMMs, or "" where it can: the CPU
// emulates them; CUDA needs compute capability 8.9+ (Ada, Hopper). One
// tiny _scaled_mm asks the device.
std::string float8_unavailable(c10::Device device);

}  // namespace amp::detail
