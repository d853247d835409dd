// Private: the live initialization as recomputation sees it - the models'
// weights a block's forward reads, the buffers a rerun restores, and where
// provenance keeps forward records. The session (session/context.h)
// implements it.
#pragma once

#include "interception/dispatch/forward_watch.h"
#include "model/model_weights.h"
#include "step/overflow_provenance.h"

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

// The live session (sharing ownership of the whole initialization), or null.
std::shared_ptr<RecomputeSession> live_recompute_session();

}  // namespace amp::detail
