// SPDX-License-Identifier: BSD-3-Clause
#include "step/overflow_provenance.h"

#include "step/guard.h"
#include "step/step_session.h"
#include "autograd/stand_ins.h"
#include "support/host_read.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <cmath>
#include <optional>
#include <unordered_set>
#include <utility>

namespace amp::detail {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

// The module of the named parameter nearest to `node` along backward
// (breadth first, at most kDepth nodes on: a linear layer's matmul reaches
// its bias through a cast; a recomputed block's stand-ins do not count),
// without the parameter's own name; "" if none.
std::string module_of(const Node& node, const ParameterNames& names) {
  constexpr int kDepth = 4;
  std::vector<const Node*> level{&node};
  for (int depth = 0; depth < kDepth && !level.empty(); ++depth) {
    std::vector<const Node*> next_level;
    for (size_t i = 0; i < level.size(); ++i) {
      for (const auto& edge : level[i]->next_edges()) {
        const Node* next = edge.function.get();
        if (next == nullptr) continue;
        if (is_stand_ins(*next)) {
          level.push_back(next);  // on this level: what it stands for is one node on
          continue;
        }
        const auto* leaf = dynamic_cast<const torch::autograd::AccumulateGrad*>(next);
        if (leaf == nullptr) {
          next_level.push_back(next);
          continue;
        }
        auto it = names.find(leaf->variable.unsafeGetTensorImpl());
        if (it == names.end()) continue;
        const size_t dot = it->second.rfind('.');
        return dot == std::string::npos ? std::string() : it->second.substr(0, dot);
      }
    }
    level = std::move(next_level);
  }
  return {};
}

class NodeHook final : public torch::autograd::FunctionPostHook {
 public:
  NodeHook(std::weak_ptr<ProvenanceTrace> trace, std::string op, std::string module)
      : trace_(std::move(trace)), op_(std::move(op)), module_(std::move(module)) {}

  variable_list operator()(const variable_list& produced, const variable_list& received) override {
    if (auto trace = trace_.lock()) trace->record_node(op_, module_, received, produced);
    return produced;
  }
  const std::weak_ptr<ProvenanceTrace>& trace() const { return trace_; }

 private:
  std::weak_ptr<ProvenanceTrace> trace_;
  std::string op_, module_;
};

// Whether each group of 0-dim tensors holds only finite values, read in
// one copy per device (records may live on several).
std::vector<bool> finite_groups(const std::vector<const std::vector<at::Tensor>*>& groups) {
  std::vector<at::Tensor> all;
  for (const auto* group : groups) all.insert(all.end(), group->begin(), group->end());
  const std::vector<double> values = read_to_host(all);
  std::vector<bool> finite(groups.size(), true);
  size_t next = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g]->size(); ++i, ++next) {
      if (!std::isfinite(values[next])) finite[g] = false;
    }
  }
  return finite;
}

}  // namespace

std::shared_ptr<ProvenanceTrace> ProvenanceTrace::watch(const at::Tensor& scaled_loss,
                                                        std::shared_ptr<const ParameterNames> names,
                                                        ForwardLog* forward) {
  std::shared_ptr<ProvenanceTrace> trace(new ProvenanceTrace(std::move(names)));
  trace->self_ = trace;
  const ParameterNames& by_tensor = *trace->names_;
  std::unordered_map<const Node*, std::string> module_by_node;
  std::vector<Node*> unvisited;
  if (const auto& root = scaled_loss.grad_fn()) unvisited.push_back(root.get());
  while (!unvisited.empty()) {
    Node* node = unvisited.back();
    unvisited.pop_back();
    if (module_by_node.count(node)) continue;
    const std::string& module = module_by_node[node] = module_of(*node, by_tensor);
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node) == nullptr) {
      node->add_post_hook(std::make_unique<NodeHook>(trace, node->name(), module));
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) unvisited.push_back(edge.function.get());
    }
  }
  if (forward == nullptr) return trace;
  for (ForwardRecord& r : forward->claim([&](const Node* n) { return module_by_node.count(n) > 0; })) {
    const auto node = r.node.lock();
    std::string module = r.module ? *r.module : node ? module_by_node[node.get()] : std::string();
    trace->forward_.push_back({*r.op, std::move(module), r.dtype, std::move(r.read_amax),
                               std::move(r.returned_amax)});
  }
  return trace;
}

void ProvenanceTrace::watch_nodes(const std::vector<Node*>& nodes) {
  for (Node* node : nodes) {
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node) != nullptr) continue;
    node->add_post_hook(std::make_unique<NodeHook>(self_, node->name(), module_of(*node, *names_)));
  }
}

void ProvenanceTrace::record_node(const std::string& op, const std::string& module,
                                  const at::TensorList received, const at::TensorList produced) {
  std::vector<at::Tensor> made = amax_each(produced);
  if (made.empty()) return;
  c10::ScalarType dtype = c10::kFloat;
  for (const at::Tensor& g : produced) {
    if (g.defined()) {
      dtype = g.scalar_type();
      break;
    }
  }
  std::vector<at::Tensor> read = amax_each(received);
  std::lock_guard<std::mutex> lock(mutex_);
  nodes_.push_back({op, module, dtype, std::move(read), std::move(made)});
}

void ProvenanceTrace::record_gradients(const std::vector<at::Tensor>& params,
                                       const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    std::vector<at::Tensor> amax = amax_each(grads[i]);
    if (amax.empty()) continue;
    grad_params_.push_back(params[i].unsafeGetTensorImpl());
    grad_amax_.push_back(std::move(amax.front()));
  }
}

OverflowReport ProvenanceTrace::report(int loss_id, double loss_scale) const {
  OverflowReport report;
  report.loss_id = loss_id;
  report.loss_scale = loss_scale;
  std::lock_guard<std::mutex> lock(mutex_);
  // Groups: each forward op's reads and outputs, each node's, each gradient.
  std::vector<const std::vector<at::Tensor>*> groups;
  for (const auto* records : {&forward_, &nodes_}) {
    for (const OpRecord& r : *records) {
      groups.push_back(&r.read_amax);
      groups.push_back(&r.made_amax);
    }
  }
  std::vector<std::vector<at::Tensor>> each_gradient;
  for (const at::Tensor& amax : grad_amax_) each_gradient.push_back({amax});
  for (const auto& g : each_gradient) groups.push_back(&g);
  const std::vector<bool> finite = finite_groups(groups);

  // The first record that made an inf/NaN (forward: whatever it read;
  // backward: from finite gradients).
  auto first_to_make = [&](const std::vector<OpRecord>& records, size_t offset, bool forward)
      -> std::optional<NonFiniteOp> {
    for (size_t i = 0; i < records.size(); ++i) {
      const bool read_finite = finite[offset + 2 * i], made_finite = finite[offset + 2 * i + 1];
      if (made_finite || (!forward && !read_finite)) continue;
      const OpRecord& r = records[i];
      return NonFiniteOp{r.op, r.module, r.dtype, forward && !read_finite};
    }
    return std::nullopt;
  };
  report.forward = first_to_make(forward_, 0, /*forward=*/true);
  report.backward = first_to_make(nodes_, 2 * forward_.size(), /*forward=*/false);
  const size_t grads_at = 2 * (forward_.size() + nodes_.size());
  for (size_t i = 0; i < grad_params_.size(); ++i) {
    if (finite[grads_at + i]) continue;
    auto it = names_->find(grad_params_[i]);
    report.non_finite_gradients.push_back(it != names_->end() ? it->second : "(unnamed parameter)");
  }
  return report;
}

void adopt_recomputed_records(ForwardLog& log, const std::vector<Node*>& inside,
                              const std::shared_ptr<Node>& node, const ParameterNames& names) {
  const std::unordered_set<const Node*> in_block(inside.begin(), inside.end());
  log.edit([&](ForwardRecord& r) {
    const std::shared_ptr<Node> own = r.node.lock();
    if (!own || !in_block.count(own.get())) return;
    if (!r.module) r.module = module_of(*own, names);
    r.node = node;
  });
}

namespace {

// The trace of one guard: watching its loss's graph from the start, given
// the unscaled gradients and handed to the verdict.
class ProvenancePart final : public GuardPart {
 public:
  explicit ProvenancePart(std::shared_ptr<ProvenanceTrace> trace) : trace_(std::move(trace)) {}
  void judged(Guard& guard, OverflowVerdict& verdict) override {
    std::vector<at::Tensor> params, grads;
    for (const GradSlot& s : guard.slots()) {
      params.push_back(s.param);
      grads.push_back(s.param.grad());
    }
    trace_->record_gradients(params, grads);
    verdict.trace = std::move(trace_);
  }

 private:
  std::shared_ptr<ProvenanceTrace> trace_;
};

}  // namespace

std::unique_ptr<GuardPart> ProvenanceParticipant::open(Guard& guard) {
  ForwardLog* log = guard.session().forward_log();
  if (guard.passthrough()) {  // a scale of 1 never skips: nothing to explain
    if (log != nullptr) log->clear();
    return nullptr;
  }
  return std::make_unique<ProvenancePart>(ProvenanceTrace::watch(guard.scaled_loss(), guard.session().parameter_names(), log));
}

void watch_recomputed_nodes(const Node& node, const std::vector<Node*>& inside) {
  for (const auto& hook : node.post_hooks()) {
    const auto* watching = dynamic_cast<const NodeHook*>(hook.get());
    if (watching == nullptr) continue;
    if (auto trace = watching->trace().lock()) trace->watch_nodes(inside);
  }
}

}  // namespace amp::detail

namespace amp {

std::optional<OverflowReport> last_overflow(internal::OptimizerRef optimizer) {
  const auto session = detail::require_step_session("amp::last_overflow");
  const auto report = session->require_step(optimizer.get(), "amp::last_overflow").last_overflow();
  if (!report) return std::nullopt;
  return *report;
}

}  // namespace amp
