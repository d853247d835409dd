// SPDX-License-Identifier: BSD-3-Clause
// Private: where the graph one run of a recomputed block recorded meets the
// rest of the graph (recompute.h).
//
// Walking back from the run's outputs, a node the run created (on this
// thread, numbered from the mark on) is inside the block; every edge leaving
// the inside goes to
//   - an input: the gradient edge of the run's stand-in for argument i;
//   - a cast-cache copy j (`copies`): the copy's gradient edge (its
//     grad_fn; in a rerun, which meets stand-ins of the copies, the
//     stand-ins' node);
//   - a leaf that requires grad (a parameter): its gradient accumulator;
//   - anything else: a tensor with history that the block captured instead
//     of taking it as an argument (refused by the caller).
// Forward records the boundary as the recompute node's next edges; the
// rerun's boundary tells which of them each gradient it computes goes to.
// At the rerun every boundary edge is a leaf, or a node with nothing
// behind it until the rerun's backward is done, so no boundary edge lies
// behind another and that backward counts each path once.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <cstdint>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace amp::detail {

// The nodes one run creates: those of this thread numbered from here on.
struct RunMark {
  uint64_t thread = 0;
  uint64_t first_sequence_nr = 0;
  static RunMark now();
  bool created(const torch::autograd::Node& node) const;
};

struct BoundaryEdge {
  enum class Kind { kInput, kCopy, kLeaf, kCaptured };
  torch::autograd::Edge edge;
  Kind kind;
  size_t index = 0;  // kInput: the argument; kCopy: the copy
};

struct BlockBoundary {
  // Unique edges, in the order the walk met them.
  std::vector<BoundaryEdge> edges;
  // The nodes inside, for overflow provenance.
  std::vector<torch::autograd::Node*> inside;

  // `inputs`: the run's arguments (stand-ins where they reach it through
  // one). `copies`: the cache's copies (or their stand-ins) it could meet.
  static BlockBoundary walk(const std::vector<at::Tensor>& outputs, const RunMark& mark,
                            const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& copies);
};

}  // namespace amp::detail
