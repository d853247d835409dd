// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Selective recomputation (Megatron-LM's): a recomputed block keeps the
/// outputs of the ops it names from its forward, and its rerun in backward
/// takes them instead of computing them again, recomputing only the rest.
///
/// ```
///   #include <amp/selective_recompute.h>
///
///   // The block's GEMMs kept: its rerun computes the norms, activations,
///   // attention's core and dropout.
///   h = amp::recompute(amp::Keep::gemm_outputs(),
///                      [block](const at::Tensor& x) mutable { return block->forward(x); }, h);
/// ```
///
/// The outputs kept stay alive from forward to backward (more bytes than
/// amp::recompute keeps, fewer than no recomputation); the rerun skips
/// their ops (less time than amp::recompute's rerun). They are what forward
/// computed, so outputs and gradients are bit for bit those of
/// amp::recompute and of no recomputation, at every level; everything
/// recompute.h says holds (the caller's duties, nesting, several losses).
///
/// What can be kept: the outputs of ATen's functional ops with a derivative
/// of their own that draw no random numbers - mm, addmm, bmm, convolution,
/// _softmax, gelu, native_layer_norm, ... Not a composite op, such as linear
/// or matmul (they run as other ops: name those); not a view or an in-place
/// op; not dropout (a kept draw would leave the rerun's generator behind,
/// and every later mask would differ). An output the block changes in
/// place after its op returned (relu_ on a GEMM's output) is not kept: the
/// rerun computes that call again.
///
/// When it pays: where attention keeps its scores and softmax per head
/// (computed as its ops), Keep::gemm_outputs() drops them for little
/// arithmetic - at GPT-2-small's shape 78% of amp::recompute's saving of
/// peak bytes for next to none of its time. A fused attention kernel
/// (at::scaled_dot_product_attention's) keeps none of them, so there a
/// block's bytes are mostly its GEMMs' outputs: 50% of the saving for a
/// third of the time, and amp::recompute of whole blocks with the fused
/// kernel takes less memory than this with attention as its ops
/// (BENCHMARKS.md, "Where the attention keeps its scores").
///
/// Cost: once a Keep names an op, every call of that op in the process
/// passes through one more kernel of amp's (at the ADInplaceOrView key,
/// below autograd: a few hundred nanoseconds), inside recomputed blocks or
/// not.
///
/// Errors (c10::Error), each leaving nothing changed:
///   - from the Keep factories: a name that is not an ATen op, or names a
///     composite, view, in-place or random op (the message says which, and
///     what to name instead); no names; an empty predicate;
///   - in backward: a rerun whose calls of the named ops differ from
///     forward's (another op, or more or fewer calls): the block must
///     compute the same thing each time it runs.
#pragma once

#include <amp/recompute.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace amp {

/// What a recomputed block keeps of its forward for its rerun.
class Keep {
 public:
  /// A call a Keep::when predicate decides on, in forward: the op, as
  /// "aten::mm", and its tensor arguments (those in lists too), in order.
  struct Call {
    const std::string& op;                   ///< the op's name
    const std::vector<at::Tensor>& inputs;   ///< its tensor arguments
  };

  /// Nothing: the whole block reruns, as amp::recompute without a Keep.
  static Keep nothing();
  /// The outputs of the layers' GEMMs: aten::mm and aten::addmm (what
  /// nn::Linear, at::linear and at::matmul with a weight call) and
  /// aten::convolution. The rerun computes the cheap, memory-hungry rest:
  /// normalizations, activations, attention's batched GEMMs and softmax,
  /// dropout. (Under the fp8 property a linear layer's GEMM is one of
  /// amp's float8 GEMMs, which the rerun computes again.)
  static Keep gemm_outputs();
  /// The outputs of every call of these ops, each "aten::<name>" or
  /// "aten::<name>.<overload>".
  static Keep ops(std::vector<std::string> names);
  /// The outputs of the calls of these ops for which `keep` returns true,
  /// asked in forward (the rerun takes what forward kept).
  static Keep when(std::vector<std::string> names, std::function<bool(const Call&)> keep);

  /// The ops and the choice, as recomputation reads them.
  const internal::KeptOps& kept_ops() const { return kept_; }

 private:
  explicit Keep(internal::KeptOps kept);
  internal::KeptOps kept_;
};

/// amp::recompute(fn, args...) keeping what `keep` names for the rerun.
template <class Fn, class... Args>
auto recompute(const Keep& keep, Fn fn, Args&&... args) {
  return internal::recompute_keeping(keep.kept_ops(), std::move(fn), std::forward<Args>(args)...);
}

/// amp::recompute_sequential, each recomputed segment keeping what `keep`
/// names for its rerun.
inline at::Tensor recompute_sequential(const torch::nn::Sequential& sequential, int64_t segments,
                                       const at::Tensor& input, const Keep& keep) {
  return recompute_sequential(sequential, segments, input, keep.kept_ops());
}

/// amp::recompute_in_slices, each piece keeping what `keep` names for its
/// rerun.
inline at::Tensor recompute_in_slices(int64_t slices, std::function<at::Tensor(const at::Tensor&)> fn,
                                      const at::Tensor& x, const Keep& keep) {
  return recompute_in_slices(slices, std::move(fn), x, keep.kept_ops());
}

}  // namespace amp
