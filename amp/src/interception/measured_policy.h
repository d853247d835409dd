// Private: Options::measured_policy's choices (amp/measured_policy.h), which
// an intercepted GEMM or convolution asks for on its observed path.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>

namespace amp::detail {

// Whether `op` ("aten::addmm") is one the policy measures.
bool is_measured_op(const std::string& op);

// The dtype `op` runs in at these arguments (`shapes`, as MeasuredChoice
// writes them): `low`, or float32 where float32 was measured faster.
// `run(dtype)` runs the op with its arguments cast to dtype, without
// autograd; it is called only on the first call of each key.
at::ScalarType measured_dtype(const std::string& op, c10::Device device, const std::string& shapes,
                              at::ScalarType low, const std::function<void(at::ScalarType)>& run);

}  // namespace amp::detail
