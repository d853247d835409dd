// SPDX-License-Identifier: BSD-3-Clause
// Private: in two levels (recompute.h), a run's parameter gradients handed
// to their accumulators as each is complete, not when the run's rerun ends.
//
// A recompute node's rerun collects the gradients at its boundary and
// returns them when its backward is over, so that they meet the rest of the
// graph where they would have without recomputation. A run's boundary holds
// its inner blocks' parameters: collected, their gradients would wait for
// the whole run, and with them the data-parallel reductions and the steps in
// backward their accumulators' hooks start - a run's worth of whole
// gradients held at once. A parameter's gradient is handed on early, as its
// capture in the rerun's backward completes, when nothing else can add to
// it: in the backward that runs the node, no other node has an edge to the
// parameter's accumulator. It is handed on by running the accumulator as the
// backward would (its hooks, the accumulation, its post hooks), and the
// node's edge to it is cut, so that the accumulator runs once.
//
// Only where the backward running the node accumulates into every leaf,
// creates no graph and keeps none (the node runs once: its cut edges are
// never needed again), and for leaves without hooks of their own (the rerun
// sets those aside; they run once, with the accumulator, in the outer
// backward).
#pragma once

#include <torch/csrc/autograd/edge.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace amp::detail {

class EarlyHandOn {
 public:
  // Whether the backward running now is one the hand-on applies in.
  static bool applies();

  // Picks the accumulators among `wanted` (the rerun's boundary edges) that
  // only `node` reaches in the backward running now and that have no hooks
  // of their own. Call before the rerun's boundary hooks are set aside.
  EarlyHandOn(const torch::autograd::Node& node, const std::vector<torch::autograd::Edge>& wanted);
  ~EarlyHandOn();
  EarlyHandOn(const EarlyHandOn&) = delete;
  EarlyHandOn& operator=(const EarlyHandOn&) = delete;

  // Hooks the picked accumulators for the rerun's backward: each complete
  // gradient captured there is handed on, and the capture left empty.
  void arm();
  // Whether wanted[k]'s gradient was handed on.
  bool handed(size_t k) const;

  struct Leaf;  // one picked accumulator

 private:
  std::vector<std::shared_ptr<Leaf>> leaves_;  // per wanted edge; null: not picked
};

}  // namespace amp::detail
