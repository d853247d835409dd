// SPDX-License-Identifier: BSD-3-Clause
// Private: views and indexed reads of a model's weights.
//
// At O2/O5 a model's weights rest in float32 between iterations and enter
// the low dtype when a forward first reads them (model_weights.h). A view
// (`wpe.narrow(0, 0, T)`, `weight.t()`, `in_proj_weight.chunk(3)`) fixes its
// dtype when it is taken, and an indexed read (`index_select`, `w.index(...)`)
// reads the values at once, both usually before any op amp casts: left
// alone, a view taken first would read float32 for the whole forward, and a
// second forward, or a recomputed block's rerun, would read the low dtype.
// So the view and index ops of ATen get a kernel at the Autocast keys that
// lets the weights enter the low dtype before the op runs (or, sharded,
// gathers them), then calls the op below itself. Registered at the levels
// that convert the model; on tensors that are not weights, or once the
// weights are lowered, it costs one flag read and a redispatch.
#pragma once

#include "interception/dispatch/op_binding.h"

#include <ATen/core/operator_name.h>
#include <torch/library.h>

#include <functional>

namespace amp::detail {

// Whether `op` is one of the view or indexed-read ops amp watches.
bool is_weight_read(const c10::OperatorName& op);

// Registers the weight-read kernel in `library` (at casting.autocast_key)
// for each such op that `has_kernel` says amp has no kernel for yet; the
// kernels amp binds there (policy tables, user registrations, provenance)
// let the weights enter the low dtype themselves.
void watch_weight_reads(torch::Library& library, const DeviceCasting& casting,
                        const std::function<bool(const c10::OperatorName&)>& has_kernel);

}  // namespace amp::detail
