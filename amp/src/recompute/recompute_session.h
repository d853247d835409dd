// SPDX-License-Identifier: BSD-3-Clause
// Private: the live initialization as recomputation sees it - the models'
// weights a block's forward reads, the buffers a rerun restores, and where
// provenance keeps forward records. The session (session/context.h)
// implements it.
#pragma once

#include "interception/dispatch/forward_watch.h"
#include "model/model_weights.h"
#include "step/overflow_provenance.h"
#include "support/live_slot.h"

#include <memory>

namespace amp::detail {

class RecomputeSession {
 public:
  virtual ModelWeights& weights() = 0;
  // The models' buffers, named as parameter_names() names parameters.
  virtual const NamedBuffers& model_buffers() const = 0;
  virtual ForwardLog* forward_log() const = 0;
  virtual const std::shared_ptr<const ParameterNames>& parameter_names() const = 0;

 protected:
  ~RecomputeSession() = default;
};

// The live session: published by the session layer (support/live_slot.h).
LiveSlot<RecomputeSession>& live_recompute_slot();
inline std::shared_ptr<RecomputeSession> live_recompute_session() { return live_recompute_slot().get(); }

}  // namespace amp::detail
