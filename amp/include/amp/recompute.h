// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Activation recomputation (activation checkpointing, Python's
/// torch.utils.checkpoint) that keeps amp's precision exact.
///
/// amp::recompute(fn, args...) runs fn(args...) and keeps none of the
/// activations inside it - only its tensor arguments. When backward reaches
/// the block it runs fn again and backpropagates through that run. The rerun
/// happens in exactly the precision state of the forward: the same casts
/// (O1's lists, disable_casts, cast_dtype and custom_fwd regions), the cast
/// cache's copies of this iteration, the weights in the dtype forward used
/// (O2, O3, O5, sharded: the models' weights enter the low dtype, or are
/// gathered, before the block's forward runs, so both runs read them alike
/// whatever op reads them first), the same random numbers (dropout draws the same
/// masks: the CPU generator and those of the CUDA devices of the arguments),
/// and BatchNorm running statistics updated once, by forward. Outputs and
/// gradients are bit-identical to the same model without recomputation.
///
/// ```
///   struct GptImpl : torch::nn::Module {
///     at::Tensor forward(const at::Tensor& x) {
///       at::Tensor h = embed(x);
///       for (const auto& block : blocks)  // holders copied into the lambda: it runs again in backward
///         h = amp::recompute([block](const at::Tensor& in) mutable { return block->forward(in); }, h);
///       return head(h);
///     }
///   };
///
///   at::Tensor y = amp::recompute_sequential(layers, /*segments=*/4, x);  // instead of layers->forward(x)
/// ```
///
/// fn returns an at::Tensor, a std::vector<at::Tensor> or a std::tuple of
/// tensors. at::Tensor arguments are the block's inputs (they need not
/// require grad; integer ones, such as token ids, are fine); other arguments
/// are copied and passed again at the rerun. Under torch::NoGradGuard (or
/// InferenceMode) recompute is a plain call. It does not need amp to be
/// initialized, but only with it does it know the models' buffers (see
/// below). Nested recompute calls, gradient accumulation, several losses
/// (retain_graph), create_graph (gradient penalties) and
/// Options::data_parallel all work; backward nodes and forward ops inside a
/// block appear in overflow reports (overflow.h) as without recomputation.
///
/// Caller's duties: fn must compute the same thing when called again - a
/// function of its arguments, the models' parameters and buffers, and the
/// random generators; everything fn captures must live until backward
/// (capture module holders by value, in a `mutable` lambda: a holder's
/// forward is not const). Tensors read by fn that carry autograd
/// history must be passed as arguments (an error says so otherwise).
/// In-place changes fn makes to tensors other than the buffers of the models
/// passed to amp::initialize (or of the Sequential given to
/// recompute_sequential) happen again at the rerun. When the block's
/// several outputs feed separate branches, gradients are equal but may
/// differ in the last bit (backward orders the branches' additions
/// differently; as with Python's checkpoint).
///
/// Errors (c10::Error), each leaving nothing changed:
///   - fn changes one of its tensor arguments in place (recompute would not
///     see the values forward saw; clone it inside fn first);
///   - fn reads a tensor with autograd history that is not among its
///     arguments (pass it as an argument);
///   - in backward: an argument was changed in place after forward (its
///     version counter moved); backward through the block a second time
///     without retain_graph; a rerun whose outputs differ from forward's;
///   - recompute_sequential with segments < 1, or an empty Sequential.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace amp {

namespace internal {

// What a recomputed block keeps of its forward for its rerun (amp::Keep,
// selective_recompute.h): the outputs of the calls of the ATen ops named,
// those for which `when` is true where it is set. None named: nothing.
struct KeptOps {
  std::vector<std::string> names;
  std::function<bool(const std::string& op, const std::vector<at::Tensor>& inputs)> when;
};

// A block with its non-tensor arguments bound: tensor arguments in, outputs out.
using RecomputedBlock = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs `block` on `inputs` without keeping its activations (see above).
// `buffers`: named buffers, besides the models', whose in-place updates by
// the block the rerun must not repeat; `keep`: what the rerun takes from
// forward instead of computing it.
std::vector<at::Tensor> run_recomputed(RecomputedBlock block, const std::vector<at::Tensor>& inputs,
                                       std::vector<std::pair<std::string, at::Tensor>> buffers = {},
                                       const KeptOps& keep = {});

// How fn's result travels as a list of tensors.
template <class T>
struct BlockOutputs {
  static_assert(sizeof(T) == 0, "amp::recompute: fn must return at::Tensor, std::vector<at::Tensor> "
                                "or std::tuple of at::Tensor");
};
template <>
struct BlockOutputs<at::Tensor> {
  static std::vector<at::Tensor> flatten(at::Tensor t) { return {std::move(t)}; }
  static at::Tensor unflatten(std::vector<at::Tensor> v) { return std::move(v.at(0)); }
};
template <>
struct BlockOutputs<std::vector<at::Tensor>> {
  static std::vector<at::Tensor> flatten(std::vector<at::Tensor> v) { return v; }
  static std::vector<at::Tensor> unflatten(std::vector<at::Tensor> v) { return v; }
};
template <class... Ts>
struct BlockOutputs<std::tuple<Ts...>> {
  static_assert((std::is_same_v<Ts, at::Tensor> && ...), "amp::recompute: a tuple result holds tensors only");
  static std::vector<at::Tensor> flatten(std::tuple<Ts...> t) {
    return std::apply([](auto&... items) { return std::vector<at::Tensor>{std::move(items)...}; }, t);
  }
  static std::tuple<Ts...> unflatten(std::vector<at::Tensor> v) {
    return unflatten(std::move(v), std::index_sequence_for<Ts...>{});
  }
  template <size_t... I>
  static std::tuple<Ts...> unflatten(std::vector<at::Tensor> v, std::index_sequence<I...>) {
    return std::tuple<Ts...>(std::move(v.at(I))...);
  }
};

template <class T>
constexpr bool kIsTensor = std::is_same_v<std::decay_t<T>, at::Tensor>;

// amp::recompute keeping `keep` for the rerun.
template <class Fn, class... Args>
auto recompute_keeping(const KeptOps& keep, Fn fn, Args&&... args) {
  using Result = std::decay_t<std::invoke_result_t<Fn&, std::decay_t<Args>&...>>;
  std::vector<at::Tensor> inputs;
  auto collect = [&](const auto& arg) {
    if constexpr (internal::kIsTensor<decltype(arg)>) inputs.push_back(arg);
  };
  (collect(args), ...);
  // Non-tensor arguments are kept for the rerun; tensor slots are refilled.
  std::tuple<std::decay_t<Args>...> bound(std::forward<Args>(args)...);
  std::apply([](auto&... item) {
    auto drop = [](auto& a) {
      if constexpr (internal::kIsTensor<decltype(a)>) a = at::Tensor();
    };
    (drop(item), ...);
  }, bound);
  internal::RecomputedBlock block = [fn = std::move(fn), bound = std::move(bound)](
                                        const std::vector<at::Tensor>& in) mutable {
    auto call = bound;
    size_t next = 0;
    std::apply([&](auto&... item) {
      auto fill = [&](auto& a) {
        if constexpr (internal::kIsTensor<decltype(a)>) a = in[next++];
      };
      (fill(item), ...);
    }, call);
    return internal::BlockOutputs<Result>::flatten(std::apply(fn, call));
  };
  return BlockOutputs<Result>::unflatten(run_recomputed(std::move(block), inputs, {}, keep));
}

}  // namespace internal

/// Runs fn(args...) keeping none of the activations inside it, and runs it
/// again when backward reaches the block, in the precision state of the
/// forward; returns fn's result (see recompute.h). To keep some of its
/// ops' outputs for the rerun: selective_recompute.h.
template <class Fn, class... Args>
auto recompute(Fn fn, Args&&... args) {
  return internal::recompute_keeping({}, std::move(fn), std::forward<Args>(args)...);
}

/// sequential->forward(input) with its children split into `segments`
/// consecutive runs of (nearly) equal length, each recomputed but the last
/// (its activations are needed first in backward anyway), as Python's
/// checkpoint_sequential. The children take and return one tensor.
/// (`keep`: selective_recompute.h's overload.)
at::Tensor recompute_sequential(const torch::nn::Sequential& sequential, int64_t segments, const at::Tensor& input,
                                const internal::KeptOps& keep = {});

/// fn(x) computed in slices: x split into `slices` pieces along dimension 0
/// (x.chunk(slices): at most that many, the last smaller when the size does
/// not divide), fn run on each piece under amp::recompute, the outputs
/// concatenated. Forward and each rerun in backward then hold one piece's
/// activations, not the whole batch's: the block's part of a step's peak
/// falls by about `slices` times, for GEMMs of fewer rows.
///
/// ```
///   h = amp::recompute_in_slices(8, [block](const at::Tensor& x) mutable { return block->forward(x); }, h);
/// ```
///
/// For blocks that compute each row of their output from the same row of
/// their input alone - a transformer block over a batch of sequences, an
/// MLP over tokens - and not for BatchNorm in training or anything else
/// that mixes rows: the caller's duty, as fn's duties above. The autograd
/// engine sums a weight's gradients from the pieces before its accumulator
/// runs, so the weight receives one gradient a backward, as without slices
/// (step_in_backward steps it once), but that sum has slices - 1 more
/// roundings in the gradient's dtype than one GEMM over the whole batch.
/// Outputs and gradients are equal to the unsliced block's within those
/// roundings, not bit for bit. Under NoGradGuard it is a plain fn(x). With
/// sharded weights (ZeRO-3) each piece gathers the block's weights, in
/// forward and in its rerun.
///
/// Errors (c10::Error): slices < 1; x undefined or without dimensions; fn
/// returns an undefined tensor, or one whose size along dimension 0 differs
/// from its piece's (fn does not map rows to rows) - thrown at the first
/// such piece, before anything is concatenated: nothing is kept for
/// backward, though the pieces run until then drew from the random
/// generators (dropout) as any forward does.
/// (`keep`: selective_recompute.h's overload.)
at::Tensor recompute_in_slices(int64_t slices, std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x,
                               const internal::KeptOps& keep = {});

}  // namespace amp
