// SPDX-License-Identifier: BSD-3-Clause
// Private: the part of a typed kernel's observed path (op statistics,
// overflow provenance, the measured policy) that no op's signature changes,
// compiled once in observed_call.cpp rather than inlined into the kernel of
// every signature (the policy tables' build time).
#pragma once

#include "interception/dispatch/op_binding.h"

#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/SmallVector.h>

#include <string>
#include <utility>
#include <vector>

namespace amp::detail {

// The tensors of one call, gathered once. Valid while the call's arguments are.
class GatheredTensors {
 public:
  // `view`: the call's arguments (TypedArgs).
  template <class View>
  explicit GatheredTensors(const View& view) {
    view.for_each_tensor([&](const at::Tensor& t, bool in_list) { tensors_.push_back({&t, in_list}); });
  }

  template <class Fn>
  void for_each_tensor(Fn&& fn) const {
    for (const auto& [t, in_list] : tensors_) fn(*t, in_list);
  }

 private:
  c10::SmallVector<std::pair<const at::Tensor*, bool>, 8> tensors_;
};

// forward_watch.h's and call_record.h's helpers over gathered tensors.
std::vector<at::Tensor> tensors_of(const GatheredTensors& tensors);
std::string describe_tensors(const GatheredTensors& tensors);

// The dtype the measured policy runs this call of `binding`'s op in, on
// `device`: `low`, or float32 where measured faster (measured_policy.h);
// `timing_run(dtype)` runs the op once in dtype.
at::ScalarType measured_call_dtype(const OpBinding& binding, const GatheredTensors& tensors, c10::Device device,
                                   at::ScalarType low, c10::function_ref<void(at::ScalarType)> timing_run);

// A timing run's backward: from ones, where `out` requires a gradient.
void backpropagate_ones(const at::Tensor& out);

}  // namespace amp::detail
