// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// The output layer of a language model (or any large classifier) and its
/// cross-entropy in one call that never holds the logits.
///
/// amp::linear_cross_entropy(hidden, weight, bias, target, options) is
/// torch::nn::functional::cross_entropy(torch::nn::functional::linear(hidden,
/// weight, bias), target, options), computed over chunks of tokens: each
/// chunk's logits are made, reduced to its loss and gradients, and dropped
/// before the next chunk's. The full logits ([tokens, vocabulary]: 824 MB in
/// bfloat16 for GPT-2-small at batch 8, sequence 1024) and their gradient
/// never exist in any dtype; the loss layer's peak is set by one chunk.
///
/// With `chunk_vocabulary`, a chunk of tokens also walks the vocabulary in
/// windows of that many classes, joining their log-sum-exps (as Cut
/// Cross-Entropy does): the peak is set by tokens x window, so a large
/// vocabulary (256k) keeps chunks of many tokens - GEMMs that read the
/// weight once per chunk - in the same memory. The tokens' log-sum-exps come
/// first; then the gradients walk the windows one at a time, each over all
/// chunks, so the float32 sum of the weight's gradient (Precision, below) is
/// one window's rows, not the whole weight's. Each window's logits are
/// computed twice (for the log-sum-exp, for the gradient): one more GEMM per
/// chunk and window than with the vocabulary whole. The hidden rows'
/// gradient is summed over windows in float32 (tokens x width x 4 bytes).
///
/// ```
///   at::Tensor h = model->body(tokens);                        // [batch, sequence, width]
///   at::Tensor loss = amp::linear_cross_entropy(h, model->head->weight, {}, targets);
///   {
///     amp::scale_loss scaled(loss, optimizer);
///     scaled.backward();
///   }
/// ```
///
/// Precision: the two GEMMs run in the dtype amp's cast policy gives
/// at::linear at this level - the region's low dtype where amp casts (O1, O4;
/// at O2, O3, O5, O6 the dtype of a low-precision weight), the inputs' own
/// dtype where it does not (O0, disable_casts, amp not initialized). A float32
/// weight is cast through the cast cache, once an iteration, as any op's. The
/// log-sum-exp, the softmax and the loss are float32 (float64 for float64
/// inputs); the loss is returned in that dtype. Loss and gradients equal the
/// unfused linear + cross_entropy within float rounding. The weight's
/// gradient is summed over the chunks in float32 and rounded to its dtype
/// once, as the unfused GEMM over all tokens sums it (summed in bfloat16,
/// each chunk's share would be rounded into the running sum: 3-8 times the
/// unfused error over 128 chunks, and a share under half the sum's last bit
/// lost). That sum takes 4 bytes a weight element while the layer runs
/// (147 MiB for GPT-2's 50304 x 768), beside the gradient's own 2 at its end;
/// with the vocabulary in windows, 4 bytes a weight element of one window
/// (12 MiB in windows of 4096 classes), where memory is short.
/// With the fp8 property (O5), where `weight` is a layer's weight and the
/// rule chooses float8 for it (its intensity over all tokens; on CUDA a
/// chunk whose rows are not a multiple of 16 runs in bfloat16), the three
/// GEMMs run in float8 as a float8 linear layer's do: the weight quantized
/// once an iteration, each chunk's hidden rows and logit gradients with the
/// layer's scales; amp::fp8_choices lists the weight. With the vocabulary in
/// windows (chunk_vocabulary below it) the GEMMs run in bfloat16.
///
/// When the gradients are computed: with reduction mean or sum and GEMMs in
/// bfloat16, float32 or float64, forward computes them (as Liger's fused
/// linear cross-entropy does): one GEMM for the logits and the two of the
/// gradients per chunk, as many as the unfused layer; backward scales them
/// by the incoming gradient (the loss scale). With reduction none, or GEMMs
/// in float16 (whose range cannot hold unscaled gradients), forward keeps
/// each token's log-sum-exp and backward recomputes the chunk's logits (as
/// Cut Cross-Entropy does): one more GEMM, the incoming gradient applied in
/// float32 before the float16 GEMMs, as the unfused backward does. Either
/// way nothing of size tokens x vocabulary is kept.
///
/// Works inside scale_loss, amp::recompute (a recomputed block may end in
/// it), with tied embeddings (the weight is any tensor, its gradient adds to
/// the embedding's), gradient accumulation, retain_graph, and sharded weights
/// (ZeRO-3: the weight is read as any op reads it). Under torch::NoGradGuard
/// (evaluation) only the loss is computed. Not twice differentiable.
///
/// Errors (c10::Error), each before anything is computed:
///   - hidden without dimensions, or whose last size differs from weight's
///     second; weight not 2-D; bias not [vocabulary];
///   - target not an integer tensor, or not hidden's shape without its last
///     dimension; a target outside [0, vocabulary) other than ignore_index
///     (checked on the CPU; on CUDA an asynchronous device assert);
///   - hidden, weight and bias on different devices, or, where amp does not
///     cast, of different dtypes (cast them, or compute under amp's casts);
///   - class weights (options.weight()) not floating, not [vocabulary], or
///     requiring grad (they are constants here);
///   - label smoothing outside [0, 1]; chunk_tokens or chunk_vocabulary < 0;
///   - in backward: create_graph (double backward).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/options/loss.h>

#include <cstdint>

namespace amp {

/// cross_entropy(linear(hidden, weight, bias), target, options) over chunks
/// of `chunk_tokens` tokens, never holding the whole logits (see
/// linear_cross_entropy.h). hidden: [..., width]; weight: [vocabulary,
/// width]; bias: [vocabulary] or undefined; target: hidden's shape without
/// its last dimension. options: class weights, ignore_index, reduction (the
/// loss of each token, target's shape, for kNone), label smoothing.
/// chunk_tokens 0 picks the chunk: float32 logits of at most 32 MiB
/// (128 tokens at vocabulary 50304; 1024 with windows of 8192 classes),
/// whole batches of small vocabularies. chunk_vocabulary: the classes of a
/// window of the vocabulary; 0 (or the vocabulary or more) for the whole
/// vocabulary at once.
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& target,
                                const torch::nn::functional::CrossEntropyFuncOptions& options = {},
                                int64_t chunk_tokens = 0, int64_t chunk_vocabulary = 0);

/// The chunk linear_cross_entropy picks for `tokens` tokens of a
/// `vocabulary`-way output (or window of it) when chunk_tokens is 0: the
/// most tokens, a power of two, whose float32 logits fit 32 MiB; at least 1,
/// at most `tokens`.
int64_t default_loss_chunk_tokens(int64_t tokens, int64_t vocabulary);

}  // namespace amp
