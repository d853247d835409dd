// SPDX-License-Identifier: BSD-3-Clause
// Out-of-line decisions of the interception kernels: backward detection and
// the banned-op error.
#include "interception/dispatch/cast.h"
#include "interception/dispatch/cast_decision.h"
#include "interception/dispatch/op_binding.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

namespace amp::detail {

// The autograd engine sets the current graph task on every thread that
// executes a backward pass (the caller's thread for CPU, device threads for
// CUDA) and clears it afterwards.
namespace {
thread_local int t_backward_casts_allowed = 0;
thread_local int t_recomputing = 0;
}  // namespace

bool in_backward() {
  return t_backward_casts_allowed == 0 && t_recomputing == 0 && torch::autograd::get_current_graph_task_id() != -1;
}

void allow_casts_in_backward(bool allow) { t_backward_casts_allowed += allow ? 1 : -1; }

bool recomputing() { return t_recomputing != 0; }

void set_recomputing(bool on) { t_recomputing += on ? 1 : -1; }

void throw_banned(const OpBinding& binding) {
  const char* reason = binding.banned_because.load();
  const char* because = reason != nullptr ? reason : "It was registered as banned, as unsafe in low precision.";
  TORCH_CHECK(false, "amp: ", binding.display_name, " is unsafe to run in ",
              c10::toString(thread_low_dtype(binding.casting->device)), " (banned by amp's cast policy for ",
              binding.casting->device, "). ", because, " To run ", binding.display_name,
              " in float32 instead, set amp::Options::allow_banned = true, or call "
              "amp::register_float_function(\"", binding.display_name, "\").");
}

}  // namespace amp::detail
