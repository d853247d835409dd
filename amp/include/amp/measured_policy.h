// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Options::measured_policy: O1 that never costs more than it gives. A GEMM,
/// convolution or attention call whose low-precision kernel is measured
/// slower than its float32 one at that shape on this device runs in float32,
/// as O0 would (float32 must win by 5%, so that timing noise leaves
/// autocast's choice); the others run as autocast runs them. The first call
/// at each (op, shapes, dtype) times both - forward and, where an argument
/// requires a gradient, backward, casts included, interleaved runs on leaves
/// of their own graph; the program's graph and random streams are untouched -
/// and the choice is kept for the process, as cuDNN's benchmark mode keeps
/// algorithms: the same shape always gets the same choice. Backward calls
/// are never timed (they run in the dtypes forward chose). Off (the
/// default), O1 is op for op what native autocast does. Fill the table
/// before capturing a CUDA graph (the warm-up iterations a capture needs do).
///
/// ```
///   amp::Options options = amp::O1;
///   options.measured_policy = true;
///   amp::initialize(model, optimizer, options);
///   ... train ...
///   std::cout << amp::format_measured_policy(amp::measured_policy());  // what was kept in float32, and why
///   amp::save_measured_policy("policy.txt");  // a later run: load_measured_policy before training
/// ```
///
/// Measured: aten::mm, bmm, addmm, baddbmm, addbmm, matmul, linear,
/// conv1d/2d/3d, convolution, _convolution, conv_transpose1d/2d/3d,
/// conv_tbc, prelu, scaled_dot_product_attention. Other rows follow their
/// tables. Timing the first call of each shape costs a dozen extra runs of
/// it, and on CUDA a device sync each; later calls look their shape up in a
/// memo of the thread's own (a few hundred instructions a call).
/// load_measured_policy and clear_measured_policy apply to every thread from
/// its next call on.
#pragma once

#include <c10/core/DeviceType.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace amp {

/// Options::measured_policy_timer: how a measurement times one shape's two
/// candidates. `op` and `shapes` are MeasuredChoice's; `run_low()` and
/// `run_fp32()` each run the op once in that dtype (forward and, where an
/// argument requires a gradient, backward, casts included) and wait for the
/// device. Returns (low-precision ms, float32 ms). Unset (the default): the
/// fastest of 5 interleaved runs of each, after one untimed run of each. A
/// timer of one's own times with other clocks (CUDA events, a profiler), or
/// decides from a table measured elsewhere without running anything.
using MeasuredPolicyTimer = std::function<std::pair<double, double>(
    const std::string& op, const std::string& shapes, const std::function<void()>& run_low,
    const std::function<void()>& run_fp32)>;

/// The measured policy's choice for one op at one shape on one device.
struct MeasuredChoice {
  std::string op;      ///< "aten::addmm"
  c10::DeviceType device = c10::DeviceType::CPU;  ///< where it was measured
  std::string shapes;  ///< the floating arguments: "[64, 256] Float, [256, 1024] Float"
  std::string low;     ///< the level's low dtype there: "BFloat16"
  double low_ms = 0;   ///< the fastest of the timed runs, casts included
  double fp32_ms = 0;  ///< the same for float32
  bool keeps_fp32 = false;  ///< float32 was at least 5% faster: the op runs in float32
};

/// The choices made so far in this process, sorted by op and shapes.
std::vector<MeasuredChoice> measured_policy();
/// A table of them: op, device, shapes, low-precision and float32 times, choice.
std::string format_measured_policy(const std::vector<MeasuredChoice>& choices);
/// Forgets every choice: the next call of each shape measures again.
void clear_measured_policy();
/// Writes the choices to `path`, one per line; loading them gives the same
/// choices without measuring. Errors: the file cannot be written or read, or
/// a line is not one save_measured_policy wrote (nothing is loaded then).
void save_measured_policy(const std::string& path);
/// Replaces the choices with those save_measured_policy wrote to `path`;
/// errors as save_measured_policy.
void load_measured_policy(const std::string& path);

}  // namespace amp
