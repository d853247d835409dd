// SPDX-License-Identifier: BSD-3-Clause
// Private: Options::measured_policy's choices (amp/measured_policy.h), which
// an intercepted GEMM or convolution asks for on its observed path.
#pragma once

#include <amp/measured_policy.h>

#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/SmallVector.h>

#include <functional>
#include <string>
#include <utility>

namespace amp::detail {

// Whether `op` ("aten::addmm") is one the policy measures.
bool is_measured_op(const std::string& op);

// What describe_shapes writes, as numbers: per floating tensor argument its
// dtype, rank and sizes.
using ShapeKey = c10::SmallVector<int64_t, 24>;
template <class View>
ShapeKey shape_key(const View& view) {
  ShapeKey key;
  view.for_each_tensor([&](const at::Tensor& t, bool) {
    if (!t.defined() || !t.is_floating_point()) return;
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(t.dim());
    key.append(t.sizes().begin(), t.sizes().end());
  });
  return key;
}

// The dtype `op` runs in at these arguments: `low`, or float32 where float32
// was measured faster. Every GEMM of every step asks, so a decided key is
// answered from this thread's memo of the table: a hash of `shapes`, no
// string built, no lock. Otherwise the table decides, keyed by
// `describe_shapes()` (MeasuredChoice::shapes), and measures on the key's
// first call: `run(dtype)` runs the op with its arguments cast to dtype,
// timed by `timer` (Options::measured_policy_timer; null or empty: the
// default). Clearing or loading the table empties every memo.
at::ScalarType measured_dtype(const std::string& op, c10::Device device, ShapeKey shapes, at::ScalarType low,
                              c10::function_ref<std::string()> describe_shapes,
                              c10::function_ref<void(at::ScalarType)> run, const MeasuredPolicyTimer* timer);

}  // namespace amp::detail
