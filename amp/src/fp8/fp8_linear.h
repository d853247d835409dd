// Private: a linear layer's GEMMs in float8 - the forward and both
// gradients through at::_scaled_mm, with a scaler per operand (input and
// weight in the forward format, the incoming gradient in the backward
// one). The sites, one per weight, live in Fp8Gemms (fp8_gemms.h).
#pragma once

#include "fp8/fp8_scaler.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace amp::detail {

// One linear layer's scaling.
struct Fp8Site {
  Fp8Site(const Options::Fp8Scaling& recipe, at::ScalarType forward, at::ScalarType backward)
      : input(recipe, forward), weight(recipe, forward), grad_output(recipe, backward) {}
  Fp8Scaler input, weight, grad_output;
};

// input [..., in] x weight [out, in]^T (+ bias [out]), as at::linear, in
// float8; the output and the gradients in the dtypes of input, weight and
// bias. Backward: grad_input = grad . weight and grad_weight = grad^T .
// input in float8 from the operands the forward quantized, grad_bias in
// the gradient's dtype.
at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      std::shared_ptr<Fp8Site> site);

// Whether the device's float8 kernel takes these shapes: on CUDA the
// inner and outer dimensions must be multiples of 16; the CPU takes any.
bool fp8_shapes_fit(const at::Tensor& input, const at::Tensor& weight);

}  // namespace amp::detail
