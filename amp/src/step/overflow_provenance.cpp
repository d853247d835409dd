#include "step/overflow_provenance.h"

#include "context.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <cmath>
#include <unordered_set>
#include <utility>

namespace amp::detail {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

// The largest magnitude among `grads` as a 0-dim float32 tensor (inf or NaN
// when any holds one), or undefined when none is defined.
at::Tensor amax_of(at::TensorList grads) {
  std::vector<at::Tensor> dense;
  for (const at::Tensor& g : grads) {
    if (g.defined()) dense.push_back(g.is_sparse() ? g._values() : g);
  }
  if (dense.empty()) return {};
  const std::vector<at::Tensor> norms = at::_foreach_norm(dense, INFINITY);
  return at::stack(norms).to(at::kFloat).amax();
}

// The module of the named parameter nearest to `node` along backward
// (breadth first, at most kDepth nodes on: a linear layer's matmul reaches
// its bias through a cast), without the parameter's own name; "" if none.
std::string module_of(const Node& node, const ParameterNames& names) {
  constexpr int kDepth = 4;
  std::vector<const Node*> level{&node};
  for (int depth = 0; depth < kDepth && !level.empty(); ++depth) {
    std::vector<const Node*> next_level;
    for (const Node* n : level) {
      for (const auto& edge : n->next_edges()) {
        const Node* next = edge.function.get();
        if (next == nullptr) continue;
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

 private:
  std::weak_ptr<ProvenanceTrace> trace_;
  std::string op_, module_;
};

}  // namespace

std::shared_ptr<ProvenanceTrace> ProvenanceTrace::watch(const at::Tensor& scaled_loss,
                                                        std::shared_ptr<const ParameterNames> names) {
  std::shared_ptr<ProvenanceTrace> trace(new ProvenanceTrace(std::move(names)));
  const ParameterNames& by_tensor = *trace->names_;
  std::vector<Node*> unvisited;
  std::unordered_set<Node*> seen;
  if (const auto& root = scaled_loss.grad_fn()) unvisited.push_back(root.get());
  while (!unvisited.empty()) {
    Node* node = unvisited.back();
    unvisited.pop_back();
    if (!seen.insert(node).second) continue;
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node) == nullptr) {
      node->add_post_hook(std::make_unique<NodeHook>(trace, node->name(), module_of(*node, by_tensor)));
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) unvisited.push_back(edge.function.get());
    }
  }
  return trace;
}

void ProvenanceTrace::record_node(const std::string& op, const std::string& module,
                                  const at::TensorList received, const at::TensorList produced) {
  at::Tensor in = amax_of(received), out = amax_of(produced);
  if (!out.defined()) return;
  c10::ScalarType dtype = c10::kFloat;
  for (const at::Tensor& g : produced) {
    if (g.defined()) {
      dtype = g.scalar_type();
      break;
    }
  }
  if (!in.defined()) in = at::zeros({}, out.options());
  std::lock_guard<std::mutex> lock(mutex_);
  nodes_.push_back({op, module, dtype, std::move(in), std::move(out)});
}

void ProvenanceTrace::record_gradients(const std::vector<at::Tensor>& params,
                                       const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> amax;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor a = amax_of(grads[i]);
    if (!a.defined()) continue;
    grad_params_.push_back(params[i].unsafeGetTensorImpl());
    amax.push_back(a);
  }
  if (!amax.empty()) grad_amax_ = at::stack(amax);
}

OverflowReport ProvenanceTrace::report(int loss_id, double loss_scale) const {
  OverflowReport report;
  report.loss_id = loss_id;
  report.loss_scale = loss_scale;
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<at::Tensor> parts;
  for (const NodeRecord& n : nodes_) {
    parts.push_back(n.received_amax.reshape({1}));
    parts.push_back(n.produced_amax.reshape({1}));
  }
  if (grad_amax_.defined()) parts.push_back(grad_amax_.to(parts.empty() ? grad_amax_.device() : parts[0].device()));
  if (parts.empty()) return report;
  const at::Tensor host = at::cat(parts).cpu();  // the one read of the device's records
  const float* v = host.data_ptr<float>();
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (std::isfinite(v[2 * i]) && !std::isfinite(v[2 * i + 1])) {
      report.first_non_finite = NonFiniteOp{nodes_[i].op, nodes_[i].module, nodes_[i].dtype};
      break;
    }
  }
  const float* grads = v + 2 * nodes_.size();
  for (size_t i = 0; i < grad_params_.size(); ++i) {
    if (std::isfinite(grads[i])) continue;
    auto it = names_->find(grad_params_[i]);
    report.non_finite_gradients.push_back(it != names_->end() ? it->second : "(unnamed parameter)");
  }
  return report;
}

}  // namespace amp::detail

namespace amp {

std::optional<OverflowReport> last_overflow(OptimizerRef optimizer) {
  const auto context = detail::require_live_context("amp::last_overflow");
  const auto report = context->require_step(optimizer.get(), "amp::last_overflow").last_overflow();
  if (!report) return std::nullopt;
  return *report;
}

}  // namespace amp
