// SPDX-License-Identifier: BSD-3-Clause
// Private: the run-time state an interception kernel reads on every call.
#pragma once

#include <amp/cast_policy.h>
#include <amp/measured_policy.h>

#include <ATen/core/operator_name.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/ScalarType.h>

#include <atomic>
#include <string>

namespace amp::detail {

class ForwardLog;
class Fp8Gemms;
class ModelWeights;

// How amp casts on one device while an Interceptor lives. Fixed for its life.
// The flags are Properties' answers (opt_levels.h), copied for the hot path.
struct DeviceCasting {
  c10::DeviceType device;
  c10::DispatchKey autocast_key;  // AutocastCPU or AutocastCUDA
  c10::ScalarType low_dtype;      // float16 or bfloat16
  bool weights_decide = false;  // Properties::weights_decide_op_dtype()
  bool fp32_ops = true;         // Properties::runs_fp32_policies()
  bool allow_banned = false;
  // oneDNN runs its low-precision primitives in low_dtype on this device
  // (always true on CUDA); rows that need them run in float32 otherwise.
  bool onednn_low_precision = true;
  // The models' lowered weights (O2/O3/O5), which an op may have to prepare
  // first (model_weights.h); null at the other levels.
  ModelWeights* weights = nullptr;
  // Where forward ops record for overflow provenance (forward_watch.h);
  // null when it is off.
  ForwardLog* forward_log = nullptr;
  // The fp8 property: linear layers' GEMMs in float8 (fp8/fp8_gemms.h);
  // null without it.
  Fp8Gemms* fp8 = nullptr;
  // Options::measured_policy_timer, the session's (null or empty: the
  // default timing runs).
  const MeasuredPolicyTimer* measured_timer = nullptr;
};

// One intercepted (operator, device) pair. Its address is stable for the
// lifetime of the kernel registered with it.
struct OpBinding {
  std::string display_name;  // "aten::softmax.int"
  bool measured = false;     // Options::measured_policy times it (measured_policy.h)
  const DeviceCasting* casting;
  // {casting->autocast_key}, which the kernel excludes while it runs; built
  // once here, as building a key set from a key costs tens of instructions.
  c10::DispatchKeySet reentry_keys;
  // The policy the kernel applies: the table's policy after the device's
  // settings (fp32_ops, allow_banned) are folded in, so the hot path reads
  // one value.
  std::atomic<CastPolicy> policy{CastPolicy::kPassthrough};
  std::atomic<const char*> banned_because{nullptr};  // the table row's reason, for kBanned
  // A view or indexed read (weight_reads.h): over a weight it starts a
  // forward by itself.
  bool weight_read = false;

  void set_policy(CastPolicy table);
};

}  // namespace amp::detail
