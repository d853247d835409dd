// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// amp's casting controls, Apex's amp.register_*_function and
/// amp.disable_casts and torch.amp's custom_fwd:
/// ```
///   cast_policy.h      the op tables, and registering a policy for an op
///   casting_scope.h    disable_casts, enable_casts (worker threads), cast_dtype,
///                      disable_cast_cache, with_current_casts
///   custom_function.h  custom_fwd / custom_bwd for autograd functions
///   cast_cache.h       the per-iteration cast cache: clear it, count it
/// ```
#pragma once

#include <amp/cast_cache.h>
#include <amp/cast_policy.h>
#include <amp/casting_scope.h>
#include <amp/custom_function.h>
