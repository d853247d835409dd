// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Why was that step skipped: which op first produced an inf/NaN - in
/// forward and in backward - and which gradients held one.
///
/// Turn it on with Options::overflow_provenance, then ask after a skip:
///
/// ```
///   options.overflow_provenance = true;
///   amp::initialize(model, optimizer, options);
///   ...
///   if (amp::last_step_skipped(optimizer)) {
///     const auto report = amp::last_overflow(optimizer);
///     // report->forward->op == "aten::addmm", ->module == "fc2",
///     //   ->input_non_finite == true (fc2's weight already held an inf)
///     // report->backward->op == "AddmmBackward0", ->module == "fc2"
///     // report->non_finite_gradients == {"fc2.weight", "fc2.bias"}
///   }
/// ```
///
/// The same is appended to the "Gradient overflow. Skipping step" log line.
///
/// Cost: healthy steps add no host sync. Every forward op run under amp with
/// gradients enabled records, on the device, the largest magnitude of the
/// floating tensors it read and returned (two foreach norms per op; ops under
/// torch::NoGradGuard, such as optimizer steps, are not watched). Each
/// backward node records the same of the gradients it received and produced,
/// and each guard of every gradient it unscaled. The host reads them only
/// when a verdict already says overflow. Off (the default), nothing is
/// recorded and the kernels run as without it.
///
/// Modules: LibTorch modules have no forward hooks, so an op's module is the
/// module of the named parameter nearest to it along its autograd graph
/// (within four nodes): a linear layer's matmul, and an op applied to its
/// output, both name the layer.
///
/// Errors (c10::Error): amp is not initialized; an optimizer that was not
/// passed to the live amp::initialize.
#pragma once

#include <amp/internal/refs.h>

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <vector>

namespace amp {

/// The first op that produced an inf or NaN.
struct NonFiniteOp {
  /// Forward: the dispatcher's op name, e.g. "aten::addmm", "aten::mul.Scalar".
  /// Backward: autograd's node name, e.g. "MmBackward0".
  std::string op;
  /// The module of the named parameter nearest it along autograd's graph
  /// ("fc2" for fc2's matmul), within four nodes; "" if none.
  std::string module;
  c10::ScalarType dtype = c10::kFloat;  ///< the dtype of what it produced
  /// Forward only: a tensor it read already held an inf/NaN - the value came
  /// from outside the watched ops (a parameter, the data, an op under
  /// torch::NoGradGuard). False: it made the first one itself, e.g. a cast to
  /// float16 of a value above 65504.
  bool input_non_finite = false;
};

/// Where the overflow that skipped a step came from.
struct OverflowReport {
  int loss_id = 0;  ///< the loss whose backward overflowed
  double loss_scale = 0;  ///< the scale the overflowed backward ran with
  /// The first forward op of the loss (in the order ops ran) whose output
  /// held an inf/NaN; empty when forward was finite.
  std::optional<NonFiniteOp> forward;
  /// The first backward node that turned finite gradients into inf/NaN;
  /// empty when none did (gradients made non-finite by the program's own
  /// hooks).
  std::optional<NonFiniteOp> backward;
  /// Parameters whose unscaled gradient held an inf or NaN, by name
  /// ("fc1.weight"; "model1.fc1.weight" with several models).
  std::vector<std::string> non_finite_gradients;
};

/// The latest overflow that skipped a step of `optimizer`, or nullopt if
/// none did (or provenance is off). After a fused step on a GPU it waits
/// for the device's verdict, as amp::last_step_skipped does.
std::optional<OverflowReport> last_overflow(internal::OptimizerRef optimizer);

}  // namespace amp
