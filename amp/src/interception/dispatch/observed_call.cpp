// SPDX-License-Identifier: BSD-3-Clause
#include "interception/dispatch/observed_call.h"

#include "interception/dispatch/call_record.h"
#include "interception/dispatch/forward_watch.h"
#include "interception/measured_policy.h"

#include <ATen/ops/ones_like.h>

namespace amp::detail {

std::vector<at::Tensor> tensors_of(const GatheredTensors& tensors) { return tensors_of<GatheredTensors>(tensors); }

std::string describe_tensors(const GatheredTensors& tensors) { return describe_tensors<GatheredTensors>(tensors); }

at::ScalarType measured_call_dtype(const OpBinding& binding, const GatheredTensors& tensors, c10::Device device,
                                   at::ScalarType low, c10::function_ref<void(at::ScalarType)> timing_run) {
  return measured_dtype(binding.display_name, device, shape_key(tensors), low, [&] { return describe_shapes(tensors); },
                        timing_run, binding.casting->measured_timer);
}

void backpropagate_ones(const at::Tensor& out) {
  if (out.requires_grad()) out.backward(at::ones_like(out));
}

}  // namespace amp::detail
