// SPDX-License-Identifier: BSD-3-Clause
#include "recompute/early_hand_on.h"

#include "autograd/backward_roots.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace amp::detail {

using torch::autograd::AccumulateGrad;
using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

struct EarlyHandOn::Leaf {
  AccumulateGrad* accumulator = nullptr;
  torch::autograd::FunctionPreHook* hook = nullptr;  // armed: ours, among its tensor pre-hooks
  bool handing = false;  // its hand-on is running the accumulator (our hook passes the gradient through)
  bool handed = false;
};

namespace {

// Runs the accumulator on a gradient complete in the rerun's backward, as
// the backward running the recompute node would have: tensor hooks,
// accumulation into .grad, post hooks (data parallel, the step in backward).
class HandOnHook final : public torch::autograd::FunctionPreHook {
 public:
  explicit HandOnHook(std::shared_ptr<EarlyHandOn::Leaf> leaf) : leaf_(std::move(leaf)) {}

  variable_list operator()(const variable_list& grads) override {
    EarlyHandOn::Leaf& leaf = *leaf_;
    if (leaf.handing || grads.size() != 1 || !grads[0].defined()) return grads;
    leaf.handing = true;
    struct Done {
      bool& flag;
      ~Done() { flag = false; }
    } done{leaf.handing};
    torch::autograd::Engine::get_default_engine().execute({Edge(leaf.accumulator->getptr(), 0)}, {grads[0]},
                                                          /*keep_graph=*/true, /*create_graph=*/false,
                                                          /*accumulate_grad=*/true, /*outputs=*/{});
    leaf.handed = true;
    return {at::Tensor()};  // the capture stays empty: the node returns nothing for it
  }

 private:
  std::shared_ptr<EarlyHandOn::Leaf> leaf_;
};

// How many edges reach each leaf accumulator in the backward running now:
// from the nodes it reaches and from its root (the engine lists the nodes
// but not the root: the guards' roots are taken from their registry). Null
// when the running backward's root is not known. Counted once a backward.
const std::unordered_map<const Node*, int>* edges_into_accumulators() {
  thread_local int counted_task = -1;
  thread_local bool known = false;
  thread_local std::unordered_map<const Node*, int> counts;
  const int task = torch::autograd::get_current_graph_task_id();
  if (task == counted_task) return known ? &counts : nullptr;
  counted_task = task;
  counts.clear();
  known = false;
  const std::unordered_set<Node*>* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (nodes == nullptr) return nullptr;
  auto count_edges = [&](const Node& node) {
    for (const Edge& e : node.next_edges()) {
      if (dynamic_cast<const AccumulateGrad*>(e.function.get()) != nullptr) ++counts[e.function.get()];
    }
  };
  for (const Node* node : *nodes) count_edges(*node);
  // A registered root is this backward's when every node it reaches is in it.
  for (const auto& root : BackwardFromRoot::running()) {
    const bool ours = std::all_of(root->next_edges().begin(), root->next_edges().end(), [&](const Edge& e) {
      return !e.function || nodes->count(e.function.get()) > 0;
    });
    known = known || ours;
    count_edges(*root);  // every registered root's edges: more edges only ever hand on less
  }
  return known ? &counts : nullptr;
}

}  // namespace

bool EarlyHandOn::applies() {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  return exec_info != nullptr && exec_info->empty() && !torch::autograd::get_current_graph_task_keep_graph() &&
         !at::GradMode::is_enabled();
}

EarlyHandOn::EarlyHandOn(const Node& node, const std::vector<Edge>& wanted) : leaves_(wanted.size()) {
  const std::unordered_map<const Node*, int>* into = edges_into_accumulators();
  if (into == nullptr) return;
  std::unordered_map<const Node*, int> from_node;  // the run node's own edges into each
  for (const Edge& e : node.next_edges()) ++from_node[e.function.get()];
  for (size_t k = 0; k < wanted.size(); ++k) {
    auto* accumulator = dynamic_cast<AccumulateGrad*>(wanted[k].function.get());
    if (accumulator == nullptr || !accumulator->tensor_pre_hooks().empty()) continue;
    const auto found = into->find(accumulator);
    if (found == into->end() || found->second != from_node[accumulator]) continue;  // something else adds to it
    leaves_[k] = std::make_shared<Leaf>();
    leaves_[k]->accumulator = accumulator;
  }
}

void EarlyHandOn::arm() {
  for (const auto& leaf : leaves_) {
    if (!leaf) continue;
    auto hook = std::make_unique<HandOnHook>(leaf);
    leaf->hook = hook.get();
    leaf->accumulator->tensor_pre_hooks().push_back(std::move(hook));
  }
}

EarlyHandOn::~EarlyHandOn() {
  for (const auto& leaf : leaves_) {
    if (!leaf || leaf->hook == nullptr) continue;
    auto& hooks = leaf->accumulator->tensor_pre_hooks();
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.get() == leaf->hook; }),
                hooks.end());
  }
}

bool EarlyHandOn::handed(size_t k) const { return leaves_[k] && leaves_[k]->handed; }

}  // namespace amp::detail
