// SPDX-License-Identifier: BSD-3-Clause
// amp::recompute (recompute.h): the block's forward runs as it would without
// recomputation - with gradients on, so amp's kernels, the cast cache and
// the models' weights behave exactly as in any forward - and the graph it
// records is dropped at once, its boundary kept as the next edges of one
// node. Backward reaches that node, reruns the block in the forward's state
// (forward_replay.h) and backpropagates through the rerun to the boundary,
// handing each gradient to the edge forward recorded for it. Gradients meet
// the rest of the graph where they would have without recomputation (the
// cast cache's copies included), so they add up in the same order.
#include <amp/recompute.h>

#include "recompute/recompute_session.h"
#include "recompute/block_boundary.h"
#include "recompute/early_hand_on.h"
#include "recompute/forward_replay.h"
#include "recompute/kept_outputs.h"
#include "autograd/stand_ins.h"
#include "support/trace_range.h"
#include "support/graph_capture.h"
#include "step/overflow_provenance.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <unordered_set>
#include <utility>

namespace amp {
namespace detail {

LiveSlot<RecomputeSession>& live_recompute_slot() {
  static LiveSlot<RecomputeSession> slot;
  return slot;
}

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

// Whether argument `a` reaches the block as a stand-in: it requires grad
// and is not a leaf (a weight passed as an argument is taken as it is).
bool through_node(const at::Tensor& a) { return a.defined() && a.requires_grad() && !a.is_leaf(); }

// The arguments one run of the block receives: where `through[i]`, a
// stand-in for args[i] leading to edges[i] (an activation, as the argument
// is: never cached as a weight); otherwise args[i] itself.
struct BlockRun {
  std::vector<std::shared_ptr<Node>> stand_ins;
  std::vector<at::Tensor> inputs;

  BlockRun(const std::vector<at::Tensor>& args, const std::vector<bool>& through,
           torch::autograd::edge_list edges = {}) {
    edges.resize(args.size());
    for (size_t i = 0; i < args.size(); ++i) {
      inputs.push_back(through[i] ? stand_in(args[i], std::move(edges[i]), stand_ins) : args[i]);
    }
  }
};

// User hooks on the boundary's leaves (tensor.register_hook on a weight)
// run once, when the outer backward hands the gradient on; the rerun's
// backward only collects it. Set aside for that backward, then put back.
class LeafHooksAside {
 public:
  explicit LeafHooksAside(const std::vector<Edge>& edges) {
    for (const Edge& e : edges) {
      auto* leaf = dynamic_cast<torch::autograd::AccumulateGrad*>(e.function.get());
      if (leaf == nullptr || leaf->tensor_pre_hooks().empty()) continue;
      aside_.emplace_back(leaf, std::move(leaf->tensor_pre_hooks()));
      leaf->tensor_pre_hooks().clear();
    }
  }
  ~LeafHooksAside() {
    for (auto& [leaf, hooks] : aside_) leaf->tensor_pre_hooks() = std::move(hooks);
  }
  LeafHooksAside(const LeafHooksAside&) = delete;
  LeafHooksAside& operator=(const LeafHooksAside&) = delete;

 private:
  std::vector<std::pair<torch::autograd::AccumulateGrad*,
                        std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>>>> aside_;
};

std::vector<int64_t> versions_of(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> out;
  for (const at::Tensor& t : tensors) out.push_back(t.defined() ? t._version() : 0);
  return out;
}

// A block's run (its forward, or its rerun in backward) as the models'
// weights see it: with sharded weights (ZeRO-3) what the run gathered is
// freed when it ends.
class BlockRunWeights {
 public:
  BlockRunWeights(std::shared_ptr<RecomputeSession> session, size_t rerun_of = ShardedWeights::kForward)
      : session_(std::move(session)) {
    if (session_) id_ = session_->weights().begin_block(rerun_of);
  }
  ~BlockRunWeights() {
    if (session_) session_->weights().end_block();
  }
  BlockRunWeights(const BlockRunWeights&) = delete;
  BlockRunWeights& operator=(const BlockRunWeights&) = delete;
  size_t id() const { return id_; }

 private:
  std::shared_ptr<RecomputeSession> session_;
  size_t id_ = 0;
};

class RecomputeNode final : public Node {
 public:
  struct Saved {
    internal::RecomputedBlock block;
    std::vector<at::Tensor> args;  // the arguments, sharing their version counters
    std::vector<bool> through;     // through_node, in forward
    std::vector<int64_t> versions;
    std::unique_ptr<ForwardReplay> replay;
    std::shared_ptr<KeptOutputs> kept;  // what forward kept for the rerun (amp::Keep); null: nothing
    std::vector<BoundaryEdge> boundary;  // one per next edge; kCopy indexes replay's copies
    size_t block_outputs = 0;
    std::weak_ptr<RecomputeSession> session;  // forward's, with the block's id there
    size_t block_id = 0;
  };

  explicit RecomputeNode(Saved saved) : saved_(std::move(saved)) {}

  std::string name() const override { return "amp::RecomputeBackward"; }
  void release_variables() override { saved_.reset(); }

  // This node's input k is the block's output output_of(k).
  void add_output(const at::Tensor& wrapped, size_t block_output) {
    torch::autograd::create_gradient_edge(const_cast<at::Tensor&>(wrapped), shared_from_this());
    output_of_.push_back(block_output);
  }

  variable_list apply(variable_list&& grads) override;

 private:
  std::optional<size_t> slot_of(const BoundaryEdge& b) const;
  void check_arguments() const;
  torch::autograd::edge_list input_edges() const;

  std::optional<Saved> saved_;
  std::vector<size_t> output_of_;
};

void RecomputeNode::check_arguments() const {
  for (size_t i = 0; i < saved_->args.size(); ++i) {
    const at::Tensor& a = saved_->args[i];
    TORCH_CHECK(!a.defined() || a._version() == saved_->versions[i], "amp::recompute: tensor argument ",
                i, " of a recomputed block was changed in place after the block's forward (its version "
                "counter moved from ", saved_->versions[i], " to ", a._version(), "), so backward cannot "
                "rerun the block on the values forward saw. Change a clone instead, or change it after "
                "backward.");
  }
}

// Argument i's edge where it reaches the block through a stand-in.
torch::autograd::edge_list RecomputeNode::input_edges() const {
  torch::autograd::edge_list edges(saved_->args.size());
  for (size_t s = 0; s < saved_->boundary.size(); ++s) {
    if (saved_->boundary[s].kind == BoundaryEdge::Kind::kInput) edges[saved_->boundary[s].index] = next_edge(s);
  }
  return edges;
}

// Which next edge a gradient the rerun computed at `b` belongs to.
std::optional<size_t> RecomputeNode::slot_of(const BoundaryEdge& b) const {
  const std::vector<BoundaryEdge>& forward = saved_->boundary;
  for (size_t s = 0; s < forward.size(); ++s) {
    const BoundaryEdge& f = forward[s];
    if (f.kind != b.kind) continue;
    if (b.kind == BoundaryEdge::Kind::kLeaf ? f.edge == b.edge : f.index == b.index) return s;
  }
  return std::nullopt;
}

variable_list RecomputeNode::apply(variable_list&& grads) {
  TORCH_CHECK(saved_.has_value(), "amp::recompute: backward reached a recomputed block whose graph an "
              "earlier backward already freed. Pass retain_graph=true to the earlier backward "
              "(scaled.backward(true)) to backpropagate through the graph twice.");
  check_arguments();
  AMP_TRACE_RANGE("amp::recompute (forward rerun and backward)");
  const bool create_graph = at::GradMode::is_enabled();  // the engine's mode: create_graph

  // The rerun, in the forward's state, meeting stand-ins of the cast
  // cache's copies forward met.
  BlockRun run(saved_->args, saved_->through, input_edges());
  std::vector<at::Tensor> copies;
  for (const CachedCopy& c : saved_->replay->cached_copies()) {
    copies.push_back(stand_in(c.copy, torch::autograd::impl::gradient_edge(c.copy), run.stand_ins));
  }
  RunMark mark;
  std::vector<at::Tensor> outputs;
  // The rerun's weights, gathered (ZeRO-3) until its backward is done.
  std::optional<BlockRunWeights> weights(std::in_place, saved_->session.lock(), saved_->block_id);
  {
    ForwardReplay::Scope replay(*saved_->replay, copies);
    KeptOutputs::Scope kept(saved_->kept.get(), KeptOutputs::Scope::Mode::kServe);
    at::AutoGradMode grad(true);
    mark = RunMark::now();
    outputs = saved_->block(run.inputs);
  }
  if (saved_->kept) saved_->kept->check_all_served();
  TORCH_CHECK(outputs.size() == saved_->block_outputs, "amp::recompute: the block returned ", outputs.size(),
              " tensors when backward ran it again, ", saved_->block_outputs, " in forward; it must "
              "compute the same thing each time it runs.");
  torch::autograd::edge_list roots;
  variable_list root_grads;
  for (size_t k = 0; k < grads.size(); ++k) {
    if (!grads[k].defined()) continue;
    const at::Tensor& out = outputs[output_of_[k]];
    TORCH_CHECK(out.defined() && out.requires_grad(), "amp::recompute: output ", output_of_[k],
                " of the block needed a gradient in forward but not when backward ran it again; it must "
                "compute the same thing each time it runs.");
    roots.push_back(torch::autograd::impl::gradient_edge(out));
    root_grads.push_back(grads[k]);
  }
  variable_list result(num_outputs());
  if (roots.empty()) return result;

  const BlockBoundary boundary = BlockBoundary::walk(outputs, mark, run.inputs, copies);
  watch_recomputed_nodes(*this, boundary.inside);
  torch::autograd::edge_list wanted;
  std::vector<std::optional<size_t>> slots;
  for (const BoundaryEdge& b : boundary.edges) {
    TORCH_CHECK(b.kind != BoundaryEdge::Kind::kCaptured, "amp::recompute: when backward ran the block "
                "again it read a tensor with autograd history (at ", b.edge.function->name(), ") that "
                "forward did not; it must compute the same thing each time it runs.");
    wanted.push_back(b.edge);
    slots.push_back(slot_of(b));
    TORCH_CHECK(slots.back().has_value(), "amp::recompute: when backward ran the block again it read a "
                "tensor that needs a gradient (at ", b.edge.function->name(), ") that forward did not; it must "
                "compute the same thing each time it runs.");
  }
  // A run's rerun holds its blocks' reruns: their parameters' gradients go
  // on as each is complete (early_hand_on.h).
  const bool holds_blocks = std::any_of(boundary.inside.begin(), boundary.inside.end(),
                                        [](const Node* n) { return dynamic_cast<const RecomputeNode*>(n) != nullptr; });
  std::optional<EarlyHandOn> early;
  if (holds_blocks && EarlyHandOn::applies()) early.emplace(*this, wanted);
  variable_list partial;
  {
    LeafHooksAside hooks(wanted);
    HiddenEdges dead_ends(run.stand_ins);
    if (early) early->arm();
    partial = torch::autograd::Engine::get_default_engine().execute(
        roots, root_grads, /*keep_graph=*/create_graph, create_graph, /*accumulate_grad=*/false, wanted);
  }
  weights.reset();
  for (size_t j = 0; j < partial.size(); ++j) {
    if (!partial[j].defined()) {
      // Handed on: the backward running this node must not run the
      // accumulator again. (Assigned in place: set_next_edge would renumber
      // the node, which it refuses once the node has parents.)
      if (early && early->handed(j)) next_edges_[*slots[j]] = Edge();
      continue;
    }
    at::Tensor& into = result[*slots[j]];
    into = into.defined() ? into + partial[j] : partial[j];
  }
  return result;
}

}  // namespace

}  // namespace detail

namespace internal {

std::vector<at::Tensor> run_recomputed(RecomputedBlock block, const std::vector<at::Tensor>& args,
                                       std::vector<std::pair<std::string, at::Tensor>> buffers, const KeptOps& keep) {
  using detail::BoundaryEdge;
  if (!at::GradMode::is_enabled() || c10::InferenceMode::is_enabled()) return block(args);
  for (const at::Tensor& a : args) {
    TORCH_CHECK(!a.defined() || !a.is_cuda() || !detail::capturing(a.device()), "amp::recompute cannot run "
                "inside a CUDA graph capture: its rerun sets the random generators' states from the host. "
                "Capture without recomputation.");
  }
  const std::shared_ptr<detail::RecomputeSession> session = detail::live_recompute_session();
  if (session) {
    // Lowered (or gathered) before the block runs: its forward then reads the
    // weights as backward's rerun will, whatever op reads them first.
    session->weights().enter_forward();
    std::unordered_set<const c10::TensorImpl*> listed;
    for (const auto& b : buffers) listed.insert(b.second.unsafeGetTensorImpl());
    for (const auto& b : session->model_buffers()) {
      if (!listed.count(b.second.unsafeGetTensorImpl())) buffers.push_back(b);
    }
  }
  std::vector<at::Tensor> buffer_tensors;
  for (const auto& b : buffers) buffer_tensors.push_back(b.second);
  const std::vector<int64_t> buffer_versions = detail::versions_of(buffer_tensors);

  auto replay = std::make_unique<detail::ForwardReplay>(args);
  std::shared_ptr<detail::KeptOutputs> kept;
  if (!keep.names.empty()) kept = std::make_shared<detail::KeptOutputs>(keep);
  std::vector<bool> through;
  for (const at::Tensor& a : args) through.push_back(detail::through_node(a));
  detail::BlockRun run(args, through);
  const std::vector<int64_t> versions = detail::versions_of(args);
  const detail::RunMark mark = detail::RunMark::now();
  std::vector<at::Tensor> outputs;
  size_t block_id = 0;
  {
    detail::BlockRunWeights weights(session);
    // Its calls are this block's: an enclosing block keeps none of them.
    detail::KeptOutputs::Scope keeping(kept.get(), detail::KeptOutputs::Scope::Mode::kRecord);
    block_id = weights.id();
    outputs = block(run.inputs);
  }
  if (kept) kept->settle();
  for (size_t i = 0; i < args.size(); ++i) {
    TORCH_CHECK(!args[i].defined() || args[i]._version() == versions[i], "amp::recompute: the block "
                "changed its tensor argument ", i, " in place; backward's rerun would start from the "
                "changed values. Change a clone inside the block (x = x.clone()) instead.");
  }
  replay->keep_updated_buffers(buffers, buffer_versions);

  std::vector<detail::CachedCopy> copies = detail::cached_copies();
  std::vector<at::Tensor> copy_tensors;
  for (const detail::CachedCopy& c : copies) copy_tensors.push_back(c.copy);
  detail::BlockBoundary boundary = detail::BlockBoundary::walk(outputs, mark, run.inputs, copy_tensors);
  if (boundary.edges.empty()) return outputs;  // nothing in it needs a gradient
  std::vector<detail::CachedCopy> met;  // the copies forward met, renumbered
  torch::autograd::edge_list next;
  for (BoundaryEdge& b : boundary.edges) {
    TORCH_CHECK(b.kind != BoundaryEdge::Kind::kCaptured, "amp::recompute: the block reads a tensor with "
                "autograd history that is not one of its arguments (its grad_fn is ",
                b.edge.function->name(), "), whose gradient backward could not route through the "
                "rerun. Pass it to amp::recompute as an argument.");
    if (b.kind == BoundaryEdge::Kind::kInput) {
      next.push_back(torch::autograd::impl::gradient_edge(args[b.index]));
      continue;
    }
    if (b.kind == BoundaryEdge::Kind::kCopy) {
      met.push_back(copies[b.index]);
      b.index = met.size() - 1;
    }
    next.push_back(b.edge);
  }
  replay->keep_cached_copies(std::move(met));

  detail::RecomputeNode::Saved saved;
  saved.block = std::move(block);
  for (const at::Tensor& a : args) saved.args.push_back(detail::through_node(a) ? a.detach() : a);
  saved.through = std::move(through);
  saved.versions = versions;
  saved.replay = std::move(replay);
  saved.kept = std::move(kept);
  saved.boundary = boundary.edges;
  saved.block_outputs = outputs.size();
  saved.session = session;
  saved.block_id = block_id;
  auto node = std::make_shared<detail::RecomputeNode>(std::move(saved));
  node->set_next_edges(std::move(next));
  if (session && session->forward_log() != nullptr) {
    detail::adopt_recomputed_records(*session->forward_log(), boundary.inside, node, *session->parameter_names());
  }

  std::vector<at::Tensor> results;
  for (size_t m = 0; m < outputs.size(); ++m) {
    const at::Tensor& out = outputs[m];
    auto same = std::find_if(run.inputs.begin(), run.inputs.end(), [&](const at::Tensor& in) {
      return in.defined() && out.defined() && in.unsafeGetTensorImpl() == out.unsafeGetTensorImpl();
    });
    if (same != run.inputs.end()) {
      results.push_back(args[same - run.inputs.begin()]);  // the argument itself: its own history
    } else if (!out.defined() || !out.requires_grad()) {
      results.push_back(out);
    } else {
      at::Tensor wrapped = out.detach();
      node->add_output(wrapped, m);
      results.push_back(std::move(wrapped));
    }
  }
  return results;
}

}  // namespace internal

at::Tensor recompute_sequential(const torch::nn::Sequential& sequential, int64_t segments, const at::Tensor& input,
                                const internal::KeptOps& keep) {
  TORCH_CHECK(segments >= 1, "amp::recompute_sequential: segments must be >= 1, got ", segments, ".");
  const std::shared_ptr<torch::nn::SequentialImpl> layers = sequential.ptr();
  const int64_t n = static_cast<int64_t>(layers->size());
  TORCH_CHECK(n > 0, "amp::recompute_sequential got an empty Sequential.");
  segments = std::min(segments, n);
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  for (const auto& b : layers->named_buffers()) buffers.emplace_back(b.key(), b.value());
  auto run_layers = [layers](int64_t begin, int64_t end, at::Tensor x) {
    for (int64_t i = begin; i < end; ++i) x = layers->begin()[i].forward(x);
    return x;
  };
  at::Tensor x = input;
  for (int64_t s = 0; s + 1 < segments; ++s) {
    const int64_t begin = s * n / segments, end = (s + 1) * n / segments;
    x = internal::run_recomputed(
            [run_layers, begin, end](const std::vector<at::Tensor>& in) {
              return std::vector<at::Tensor>{run_layers(begin, end, in[0])};
            },
            {x}, buffers, keep)
            .at(0);
  }
  return run_layers((segments - 1) * n / segments, n, x);
}

at::Tensor recompute_in_slices(int64_t slices, std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x,
                               const internal::KeptOps& keep) {
  TORCH_CHECK(slices >= 1, "amp::recompute_in_slices: slices must be >= 1, got ", slices, ".");
  TORCH_CHECK(x.defined() && x.dim() >= 1, "amp::recompute_in_slices needs a tensor with a dimension 0 to "
              "slice (a batch); got ", x.defined() ? "a tensor without dimensions" : "an undefined tensor", ".");
  if (!at::GradMode::is_enabled() || c10::InferenceMode::is_enabled()) return fn(x);
  std::vector<at::Tensor> outputs;
  for (const at::Tensor& piece : x.chunk(slices)) {
    at::Tensor out = internal::run_recomputed(
                         [fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; },
                         {piece}, {}, keep)
                         .at(0);
    TORCH_CHECK(out.defined() && out.dim() >= 1 && out.size(0) == piece.size(0), "amp::recompute_in_slices: "
                "fn returned ", out.defined() ? "a tensor of sizes " + c10::str(out.sizes()) : "an undefined tensor",
                " for a piece of ", piece.size(0), " rows; it must map each row of its input to the same row of "
                "its output (a block that mixes rows cannot run in slices: use amp::recompute).");
    outputs.push_back(std::move(out));
  }
  return at::cat(outputs);
}

}  // namespace amp
