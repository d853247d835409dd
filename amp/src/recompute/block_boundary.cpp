// SPDX-License-Identifier: BSD-3-Clause
#include "recompute/block_boundary.h"

#include <ATen/record_function.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_set>

namespace amp::detail {

using torch::autograd::AccumulateGrad;
using torch::autograd::Edge;
using torch::autograd::Node;

RunMark RunMark::now() { return {at::RecordFunction::currentThreadId(), at::sequence_number::peek()}; }

bool RunMark::created(const Node& node) const {
  return node.thread_id() == thread && node.sequence_nr() >= first_sequence_nr && node.sequence_nr() != UINT64_MAX;
}

namespace {

// Each tensor's gradient edge; invalid where it needs no gradient, or is a
// leaf (a weight passed as an argument meets the walk as a leaf).
std::vector<Edge> edges_of(const std::vector<at::Tensor>& tensors, bool leaves) {
  std::vector<Edge> edges;
  for (const at::Tensor& t : tensors) {
    const bool counted = t.defined() && t.requires_grad() && (leaves || !t.is_leaf());
    edges.push_back(counted ? torch::autograd::impl::gradient_edge(t) : Edge());
  }
  return edges;
}

}  // namespace

BlockBoundary BlockBoundary::walk(const std::vector<at::Tensor>& outputs, const RunMark& mark,
                                  const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& copies) {
  const std::vector<Edge> input_edges = edges_of(inputs, /*leaves=*/false);
  const std::vector<Edge> copy_edges = edges_of(copies, /*leaves=*/true);
  BlockBoundary boundary;
  std::unordered_set<const Node*> visited;
  std::vector<Node*> unvisited;
  auto seen_edges = [&](const Edge& e) {
    for (const BoundaryEdge& b : boundary.edges) {
      if (b.edge == e) return true;
    }
    return false;
  };
  auto meet = [&](const Edge& e) {
    if (!e.is_valid()) return;
    Node* n = e.function.get();
    BoundaryEdge b{e, BoundaryEdge::Kind::kCaptured};
    const auto input = std::find(input_edges.begin(), input_edges.end(), e);
    const auto copy = std::find(copy_edges.begin(), copy_edges.end(), e);
    if (input != input_edges.end()) {
      b.kind = BoundaryEdge::Kind::kInput;
      b.index = input - input_edges.begin();
    } else if (dynamic_cast<const AccumulateGrad*>(n) != nullptr) {
      // Before copies: a cache entry whose copy is its weight itself (cast
      // through a view made before O2 lowered it) is that weight.
      b.kind = BoundaryEdge::Kind::kLeaf;
    } else if (copy != copy_edges.end()) {
      b.kind = BoundaryEdge::Kind::kCopy;
      b.index = copy - copy_edges.begin();
    } else if (mark.created(*n)) {
      if (visited.insert(n).second) unvisited.push_back(n);
      return;
    }
    if (!seen_edges(e)) boundary.edges.push_back(std::move(b));
  };
  for (const at::Tensor& out : outputs) {
    if (out.defined() && out.requires_grad()) meet(torch::autograd::impl::gradient_edge(out));
  }
  while (!unvisited.empty()) {
    Node* n = unvisited.back();
    unvisited.pop_back();
    boundary.inside.push_back(n);
    for (const Edge& e : n->next_edges()) meet(e);
  }
  return boundary;
}

}  // namespace amp::detail
