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

// The sum over valid tokens of w[y]: the mean's denominator, as ATen's.
at::Tensor mean_denominator(const at::Tensor& target, const CrossEntropyTerms& terms, at::ScalarType acc);

// Each token's loss [C] given its logits `logits` [C, V] and their
// log-sum-exp `lse` [C], both in the accumulation dtype.
at::Tensor token_losses(const at::Tensor& logits, const at::Tensor& lse, const ChunkTargets& targets,
                        const CrossEntropyTerms& terms);

// Turns `logits` [C, V] (accumulation dtype, overwritten) into
// row_scale[i] * dloss_i/dlogits, given their log-sum-exp. row_scale [C]:
// the incoming gradient of each token's loss (and the mean's 1/denominator);
// ignored tokens' rows become 0.
void logits_to_gradient_(at::Tensor& logits, const at::Tensor& lse, const ChunkTargets& targets,
                         const CrossEntropyTerms& terms, const at::Tensor& row_scale);

}  // namespace amp::detail
