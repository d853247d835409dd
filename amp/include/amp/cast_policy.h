// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Cast policies: what amp does to an operator's floating-point arguments.
///
/// While amp intercepts ops (O1/O4, and O2/O3/O5 to meet a low-precision
/// model), every operator in the policy table of a device is routed through
/// amp's kernel at that device's Autocast dispatch key, which casts the
/// arguments per the op's policy and calls the op again below itself. Every
/// other operator runs untouched. The default tables mirror LibTorch 2.11's
/// native autocast lists for CPU and CUDA (amp/src/interception/policy_tables/); the
/// effective tables, with user registrations, are readable via policy_table().
///
/// Users add operators by name, in any namespace, before or after initialize:
///
/// ```
///   amp::register_float_function("mylib::fused_norm");      // always fp32
///   amp::register_half_function("aten::cudnn_convolution");  // low precision
///   amp::register_promote_function("mylib::blend.Tensor");   // widest dtype
/// ```
///
/// A name without an overload ("mylib::op") means the default overload. A
/// registration replaces the op's policy on the given device (or on CPU and
/// CUDA when none is given).
///
/// Errors (c10::Error): an operator that is not registered with the LibTorch
/// dispatcher (load its library first); a malformed name (expected
/// "namespace::name" or "namespace::name.overload"); kFp32SetOptDtype for an op
/// without a `ScalarType? dtype` argument; kFp32AppendDtype (only built-in
/// table entries can redirect to a dtype overload).
#pragma once

#include <c10/core/DeviceType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace amp {

/// What amp does to an operator's floating-point arguments.
enum class CastPolicy : uint8_t {
  /// Cast floating arguments to the device's low-precision dtype (fp16/bf16).
  /// An fp32 leaf weight is cast once per iteration (the cast cache). At
  /// O2/O3 the op runs in the dtype of its weights instead, so fp32 inputs meet
  /// a low-precision model and modules kept fp32 compute in fp32.
  kLowerPrecision,
  /// Cast floating arguments to float32.
  kFp32,
  /// Ask for float32 output through the op's own `ScalarType? dtype` argument
  /// (softmax, log_softmax, sum, prod, cumsum, ...) when the caller did not.
  kFp32SetOptDtype,
  /// Redirect to the overload that takes a dtype, with float32 (CUDA norm).
  kFp32AppendDtype,
  /// Run in the widest floating dtype among the arguments, tensor lists
  /// included (cat, stack); float64 arguments are left alone.
  kPromote,
  /// Refuse: unsafe in low precision (binary_cross_entropy on CUDA). The error
  /// names the safe alternative; Options::allow_banned runs it in float32.
  kBanned,
  /// Run exactly as without amp.
  kPassthrough,
  /// Ops taking module parameters (norms, RNNs): when float32 activations
  /// meet low-precision parameters, cast the float32 arguments to the
  /// parameters' dtype; when an argument is a float32 parameter (a module kept
  /// fp32), run as given. Bound at the levels that cast the model (O2, O3,
  /// O5), so existing code feeding float32 batches keeps working.
  kMatchParameters,
};

/// The policy's name: "lower_precision", "fp32", "fp32_set_opt_dtype",
/// "fp32_append_dtype", "promote", "banned", "passthrough" or
/// "match_parameters".
const char* to_string(CastPolicy policy);

/// One row of a policy table: an operator and its policy.
struct OpPolicy {
  std::string op;  ///< "aten::softmax.int"
  CastPolicy policy;  ///< what amp does to the op's arguments
};

/// The effective table of `device` (kCPU or kCUDA): defaults plus user
/// registrations, sorted by op name.
std::vector<OpPolicy> policy_table(c10::DeviceType device);

/// The ops amp binds, beyond the device's table, at the levels that cast the
/// model (O2, O3, O5): kMatchParameters rows, sorted by op name.
std::vector<OpPolicy> model_policy_table();

/// The effective policy of `op` on `device`; nullopt when amp leaves it alone.
std::optional<CastPolicy> policy_for(std::string_view op, c10::DeviceType device);

/// Sets `op`'s policy on `device`, or on CPU and CUDA when device is nullopt.
void register_op(std::string_view op, CastPolicy policy,
                 std::optional<c10::DeviceType> device = std::nullopt);

/// Apex's names for the three policies users register: register_op with
/// kLowerPrecision (half), kFp32 (float) and kPromote (promote).
///@{
void register_half_function(std::string_view op,
                            std::optional<c10::DeviceType> device = std::nullopt);
void register_float_function(std::string_view op,
                             std::optional<c10::DeviceType> device = std::nullopt);
void register_promote_function(std::string_view op,
                               std::optional<c10::DeviceType> device = std::nullopt);
///@}

/// Drops every user registration, restoring the default tables.
void reset_user_registrations();

}  // namespace amp
