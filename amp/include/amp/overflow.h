// Why was that step skipped: where the first inf/NaN of an overflowed
// backward came from, and which gradients held one.
//
// Turn it on with Options::overflow_provenance, then ask after a skip:
//
//   options.overflow_provenance = true;
//   amp::initialize(model, optimizer, options);
//   ...
//   if (amp::last_step_skipped(optimizer)) {
//     const auto report = amp::last_overflow(optimizer);
//     // report->first_non_finite->op == "AddmmBackward0", ->module == "fc2"
//     // report->non_finite_gradients == {"fc2.weight", "fc2.bias"}
//   }
//
// The same is appended to the "Gradient overflow. Skipping step" log line.
//
// Cost: healthy steps add no host sync. Each backward node records, on the
// device, the largest magnitude of the gradients it received and produced,
// and each guard the largest magnitude of every gradient it unscaled (one
// foreach norm); the host reads them only when a verdict already says
// overflow. Off (the default), nothing is recorded.
//
// Errors (c10::Error): amp is not initialized; an optimizer that was not
// passed to the live amp::initialize.
#pragma once

#include <amp/refs.h>

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <vector>

namespace amp {

// The first backward node that produced an inf or NaN from finite gradients.
struct NonFiniteOp {
  std::string op;      // autograd's node name, e.g. "MmBackward0"
  // The module of the named parameter nearest it along backward ("fc2" for
  // fc2's matmul), within four nodes; "" if none.
  std::string module;
  c10::ScalarType dtype = c10::kFloat;  // the dtype of the gradient it produced
};

struct OverflowReport {
  int loss_id = 0;
  double loss_scale = 0;  // the scale the overflowed backward ran with
  // Empty when no node produced the first inf/NaN: the loss itself, or
  // gradients that arrived non-finite (e.g. set by the program).
  std::optional<NonFiniteOp> first_non_finite;
  // Parameters whose unscaled gradient held an inf or NaN, by name
  // ("fc1.weight"; "model1.fc1.weight" with several models).
  std::vector<std::string> non_finite_gradients;
};

// The latest overflow that skipped a step of `optimizer`, or nullopt if
// none did (or provenance is off). After a fused step on a GPU it waits
// for the device's verdict, as amp::last_step_skipped does.
std::optional<OverflowReport> last_overflow(OptimizerRef optimizer);

}  // namespace amp
