// SPDX-License-Identifier: BSD-3-Clause
// Private: cross-entropy over one chunk of tokens' logits - each token's
// loss and the loss's gradient with respect to the logits - in the
// accumulation dtype (float32, or float64 for float64 logits), with ATen's
// semantics for class weights, ignore_index and label smoothing
// (at::cross_entropy_loss): for a token with target y, weights w and
// smoothing e over V classes,
//   loss = (1 - e) w[y] (lse - z[y]) + e/V sum_c w[c] (lse - z[c])
//   dloss/dz[c] = ((1 - e) w[y] + e/V sum w) p[c] - (1 - e) w[y] [c == y] - e/V w[c]
// with p = softmax(z); an ignored token's loss and gradient are 0.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace amp::detail {

// What the loss of every chunk shares.
struct CrossEntropyTerms {
  int64_t ignore_index = -100;
  double smoothing = 0.0;
  at::Tensor class_weights;  // [V] in the accumulation dtype, or undefined (all 1)
};

// One chunk's targets as the loss reads them.
struct ChunkTargets {
  at::Tensor valid;   // [C] bool: not ignore_index
  at::Tensor safe;    // [C] the targets, ignored ones replaced by 0 (gatherable)
  at::Tensor weight;  // [C] w[y] of each valid token, 0 for ignored ones
};

ChunkTargets chunk_targets(const at::Tensor& target, const CrossEntropyTerms& terms, at::ScalarType acc);

// Classes [begin, end) of `classes`: the columns a chunk's logits hold (all
// of them, or a window of the vocabulary).
struct ClassWindow {
  int64_t begin, end, classes;
  int64_t width() const { return end - begin; }
  bool whole() const { return begin == 0 && end == classes; }
  // The window's rows of `t` (dim 0 over the classes: a weight, a bias).
  at::Tensor rows_of(const at::Tensor& t) const { return whole() ? t : t.slice(0, begin, end); }
};

// What a token's loss needs of its logits, summed over windows: the target's
// logit, and with label smoothing sum_c w[c] z[c] (w all 1 without class
// weights). `add` takes one window's logits [C, width] (accumulation dtype).
struct LogitSums {
  at::Tensor target_logit, weighted;  // [C] each; `weighted` undefined without smoothing

  void add(const at::Tensor& logits, const ClassWindow& window, const ChunkTargets& targets,
           const CrossEntropyTerms& terms);
};

// Each token's loss [C] from its log-sum-exp `lse` [C] and the sums of its
// logits over all classes.
at::Tensor token_losses(const at::Tensor& lse, const LogitSums& sums, const ChunkTargets& targets,
                        const CrossEntropyTerms& terms, int64_t classes);

// Turns `logits` [C, width] (window `window`'s, accumulation dtype,
// overwritten) into row_scale[i] * dloss_i/dlogits, given the tokens'
// log-sum-exp over all classes. row_scale [C]: the incoming gradient of each
// token's loss (and the mean's 1/denominator); ignored tokens' rows become 0.
void logits_to_gradient_(at::Tensor& logits, const ClassWindow& window, const at::Tensor& lse,
                         const ChunkTargets& targets, const CrossEntropyTerms& terms, const at::Tensor& row_scale);

}  // namespace amp::detail
