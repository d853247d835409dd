// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// What amp can tell about a run, for when it does not train as expected or
/// to see what mixed precision bought:
/// ```
///   op_stats.h          which ops ran in which dtype, and the casts they cost
///   overflow.h          where a skipped step's inf/NaN came from
///   telemetry.h         underflow, zeros and amax per parameter; the scale history
///   memory.h            allocator bytes now and at the peak; training_bytes
///   hardware.h          what the CPU computes natively
///   model_conversion.h  which tensors O2/O3/O5 lowered, and which stayed float32
///   alignment.h         GEMM shapes that miss the hardware's multiples
///   measured_policy.h   the table behind Options::measured_policy
///   log.h               amp's events (skipped steps, warnings) to a sink of yours
/// ```
#pragma once

#include <amp/alignment.h>
#include <amp/hardware.h>
#include <amp/log.h>
#include <amp/measured_policy.h>
#include <amp/memory.h>
#include <amp/model_conversion.h>
#include <amp/op_stats.h>
#include <amp/overflow.h>
#include <amp/telemetry.h>
