// SPDX-License-Identifier: BSD-3-Clause
// Private: what one scale_loss guard records, on the device, to say where an
// overflow came from (amp/overflow.h), and the report built from it.
//
// Recording never reads the device. At guard construction the trace claims
// the forward records of its loss (interception/dispatch/forward_watch.h)
// and gives each backward node of the guarded loss a post hook that stacks
// the largest magnitude (a foreach inf-norm) of the gradients it received
// and of those it produced; the guard adds the largest magnitude of every
// gradient it unscaled. Only when the verdict says overflow does report()
// read them, in one copy per device.
#pragma once

#include <amp/overflow.h>

#include "interception/dispatch/forward_watch.h"
#include "step/step_participant.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace amp::detail {

// Parameter names of initialize's models ("fc1.weight"; "model1.fc1.weight"
// with several models), by tensor.
using ParameterNames = std::unordered_map<const c10::TensorImpl*, std::string>;

class ProvenanceTrace {
 public:
  // Hooks every node of `scaled_loss`'s graph (nodes hooked by an earlier
  // trace record into the newest one) and takes `forward`'s records of it
  // (none without a log).
  static std::shared_ptr<ProvenanceTrace> watch(const at::Tensor& scaled_loss,
                                                std::shared_ptr<const ParameterNames> names,
                                                ForwardLog* forward);

  // The unscaled gradients of `params` (same order), checked by the guard.
  void record_gradients(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads);

  // Reads what was recorded and names the first forward op and backward
  // node that produced an inf/NaN, and the gradients that hold one.
  OverflowReport report(int loss_id, double loss_scale) const;

  // Gives each of `nodes` (a recomputed block's rerun, made after this
  // trace hooked the graph) a hook recording into this trace.
  void watch_nodes(const std::vector<torch::autograd::Node*>& nodes);

  // Called by a node's hook as backward runs it.
  void record_node(const std::string& op, const std::string& module, const at::TensorList received,
                   const at::TensorList produced);

 private:
  explicit ProvenanceTrace(std::shared_ptr<const ParameterNames> names) : names_(std::move(names)) {}
  std::weak_ptr<ProvenanceTrace> self_;

  // One op or node: the largest magnitudes (0-dim, on the device) of what it
  // read and of what it made.
  struct OpRecord {
    std::string op, module;
    c10::ScalarType dtype;
    std::vector<at::Tensor> read_amax, made_amax;
  };
  std::shared_ptr<const ParameterNames> names_;
  std::vector<OpRecord> forward_;  // in the order forward ran them
  mutable std::mutex mutex_;       // backward runs nodes on device threads
  std::vector<OpRecord> nodes_;    // in the order backward ran them
  std::vector<const c10::TensorImpl*> grad_params_;
  std::vector<at::Tensor> grad_amax_;
};

// Options::overflow_provenance as a step participant: each guard traces
// its loss's graph and, once unscaled, its gradients, for its verdict.
class ProvenanceParticipant final : public StepParticipant {
 public:
  std::unique_ptr<GuardPart> open(Guard& guard) override;
};

// Recomputed blocks (recompute.h). After a block's forward: its records in
// `log` whose node is one of `inside` (about to be freed) now stand for
// `node`, the block's node in the graph guards walk, and keep the module
// their own node was nearest to.
void adopt_recomputed_records(ForwardLog& log, const std::vector<torch::autograd::Node*>& inside,
                              const std::shared_ptr<torch::autograd::Node>& node, const ParameterNames& names);
// At the block's rerun in backward: `inside`, the rerun's nodes, join every
// trace that hooked `node`.
void watch_recomputed_nodes(const torch::autograd::Node& node, const std::vector<torch::autograd::Node*>& inside);

}  // namespace amp::detail
