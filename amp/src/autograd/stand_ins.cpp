// SPDX-License-Identifier: BSD-3-Clause
#include "autograd/stand_ins.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <utility>

namespace amp::detail {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

struct StandIns final : Node {
  explicit StandIns(Edge edge) : Node(edge.is_valid() ? torch::autograd::edge_list{std::move(edge)}
                                                      : torch::autograd::edge_list{}) {}
  variable_list apply(variable_list&& grads) override { return std::move(grads); }
  std::string name() const override { return "amp::RecomputeStandIns"; }
};

}  // namespace

at::Tensor stand_in(const at::Tensor& t, Edge edge, std::vector<std::shared_ptr<Node>>& nodes) {
  at::Tensor s = t.detach();
  auto node = std::make_shared<StandIns>(std::move(edge));
  torch::autograd::create_gradient_edge(s, node);
  nodes.push_back(std::move(node));
  return s;
}

bool is_stand_ins(const Node& node) { return dynamic_cast<const StandIns*>(&node) != nullptr; }

HiddenEdges::HiddenEdges(std::vector<std::shared_ptr<Node>> nodes) : nodes_(std::move(nodes)) {
  for (const auto& n : nodes_) hidden_.push_back(std::exchange(n->next_edges(), {}));
}

HiddenEdges::~HiddenEdges() {
  for (size_t i = 0; i < nodes_.size(); ++i) nodes_[i]->next_edges() = std::move(hidden_[i]);
}

}  // namespace amp::detail
