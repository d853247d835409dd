// SPDX-License-Identifier: BSD-3-Clause
// Private: the fp8 property at the interception kernel - which GEMM calls
// run in float8. A call qualifies when one operand is a layer's weight (a
// parameter, or a transposed view of one: LibTorch's nn::Linear calls
// addmm(bias, x, weight.t()) for 2-D inputs and matmul(x, weight.t()) for
// others) and the call would run in bfloat16; the other operand and the
// bias are cast as the op's policy casts them. Everything else - attention's
// activation-by-activation GEMMs included - runs as the policy says.
#pragma once

#include "fp8/fp8_gemms.h"
#include "interception/dispatch/call_record.h"
#include "interception/dispatch/cast.h"

#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/linear_ops.h>
#include <ATen/ops/matmul_ops.h>
#include <ATen/ops/mm_ops.h>

#include <optional>

namespace amp::detail {

// A layer's weight as a GEMM operand: a 2-D parameter, or a view of one.
inline bool is_layer_weight(const at::Tensor& t) {
  if (!t.defined() || t.dim() != 2 || !t.requires_grad()) return false;
  return t.is_leaf() || (t.is_view() && t._base().is_leaf());
}

// The site a weight operand belongs to: the parameter it views.
inline const c10::TensorImpl* weight_key(const at::Tensor& t) {
  return t.is_view() ? t._base().unsafeGetTensorImpl() : t.unsafeGetTensorImpl();
}

// Whether a qualifying call runs in float8 (Fp8Gemms::choose; else it runs
// as the policy says); both counted per op.
inline bool in_float8(Fp8Gemms& fp8, const at::Tensor& input, int64_t out_features, const at::Tensor& weight) {
  const bool float8 = fp8.choose(input, out_features, weight_key(weight));
  CallRecord::note_float8(/*fell_back=*/!float8);  // a recomputed rerun's calls are not recorded
  return float8;
}

template <class Op>
struct Fp8Call {
  static constexpr bool kApplies = false;
};

template <>
struct Fp8Call<at::_ops::linear> {
  static constexpr bool kApplies = true;
  static std::optional<at::Tensor> call(Fp8Gemms& fp8, at::ScalarType to, c10::DeviceType device,
                                        const at::Tensor& input, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias) {
    if (!is_layer_weight(weight) || input.dim() < 1 || !in_float8(fp8, input, weight.size(0), weight)) {
      return std::nullopt;
    }
    ArgCastFor<at::Tensor, at::Tensor, std::optional<at::Tensor>> cast(to, device);
    return fp8.linear(cast(input), cast(weight), cast(bias), weight_key(weight), recomputing());
  }
};

template <>
struct Fp8Call<at::_ops::addmm> {
  static constexpr bool kApplies = true;
  static std::optional<at::Tensor> call(Fp8Gemms& fp8, at::ScalarType to, c10::DeviceType device,
                                        const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                                        const at::Scalar& beta, const at::Scalar& alpha) {
    if (!is_layer_weight(mat2) || !beta.equal(1) || !alpha.equal(1) || self.dim() > 1 ||
        !in_float8(fp8, mat1, mat2.size(1), mat2)) {
      return std::nullopt;
    }
    ArgCastFor<at::Tensor, at::Tensor, at::Tensor> cast(to, device);
    const at::Tensor& bias = cast(self);
    return fp8.linear(cast(mat1), cast(mat2).t(), bias, weight_key(mat2), recomputing());
  }
};

template <>
struct Fp8Call<at::_ops::mm> {
  static constexpr bool kApplies = true;
  static std::optional<at::Tensor> call(Fp8Gemms& fp8, at::ScalarType to, c10::DeviceType device,
                                        const at::Tensor& self, const at::Tensor& mat2) {
    if (!is_layer_weight(mat2) || !in_float8(fp8, self, mat2.size(1), mat2)) return std::nullopt;
    ArgCastFor<at::Tensor, at::Tensor> cast(to, device);
    return fp8.linear(cast(self), cast(mat2).t(), std::nullopt, weight_key(mat2), recomputing());
  }
};

template <>
struct Fp8Call<at::_ops::matmul> {
  static constexpr bool kApplies = true;
  static std::optional<at::Tensor> call(Fp8Gemms& fp8, at::ScalarType to, c10::DeviceType device,
                                        const at::Tensor& self, const at::Tensor& other) {
    if (!is_layer_weight(other) || self.dim() < 2 || !in_float8(fp8, self, other.size(1), other)) return std::nullopt;
    ArgCastFor<at::Tensor, at::Tensor> cast(to, device);
    return fp8.linear(cast(self), cast(other).t(), std::nullopt, weight_key(other), recomputing());
  }
};

}  // namespace amp::detail
