// SPDX-License-Identifier: BSD-3-Clause
// Private: the nodes through which one run of a recomputed block
// (recompute.cpp) reaches tensors from outside it - its arguments and the
// cast cache's copies.
//
// A stand-in shares its tensor's data and version counter; its history is
// a StandIns node whose next edge leads to that tensor. The node hands
// gradients on unchanged - in the graph a backward with create_graph
// (gradient penalties) makes through the rerun. The rerun's own backward
// must stop at it and collect what arrives, so for its extent the edge is
// hidden (HiddenEdges); made with it, the node keeps the topological number
// the engine's pruning relies on. Walks that measure distance along the
// graph (overflow provenance's nearest module) step through stand-ins.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <memory>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace amp::detail {

// A stand-in for `t` leading to `edge` (none when invalid); its node is
// appended to `nodes`.
at::Tensor stand_in(const at::Tensor& t, torch::autograd::Edge edge,
                    std::vector<std::shared_ptr<torch::autograd::Node>>& nodes);

bool is_stand_ins(const torch::autograd::Node& node);

// RAII: `nodes` (StandIns) have no next edges for the scope's extent.
class HiddenEdges {
 public:
  explicit HiddenEdges(std::vector<std::shared_ptr<torch::autograd::Node>> nodes);
  ~HiddenEdges();
  HiddenEdges(const HiddenEdges&) = delete;
  HiddenEdges& operator=(const HiddenEdges&) = delete;

 private:
  std::vector<std::shared_ptr<torch::autograd::Node>> nodes_;
  std::vector<std::vector<torch::autograd::Edge>> hidden_;
};

}  // namespace amp::detail
