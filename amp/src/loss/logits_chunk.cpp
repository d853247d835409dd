// SPDX-License-Identifier: BSD-3-Clause
#include "loss/logits_chunk.h"

#include <ATen/ATen.h>

namespace amp::detail {

ChunkTargets chunk_targets(const at::Tensor& target, const CrossEntropyTerms& terms, at::ScalarType acc) {
  ChunkTargets t;
  t.valid = target.ne(terms.ignore_index);
  t.safe = at::where(t.valid, target, at::zeros({}, target.options()));
  const at::Tensor w = terms.class_weights.defined() ? terms.class_weights.index_select(0, t.safe)
                                                     : at::ones(target.sizes(), target.options().dtype(acc));
  t.weight = at::where(t.valid, w, at::zeros({}, w.options()));
  return t;
}

at::Tensor mean_denominator(const at::Tensor& target, const CrossEntropyTerms& terms, at::ScalarType acc) {
  return chunk_targets(target, terms, acc).weight.sum();
}

at::Tensor token_losses(const at::Tensor& logits, const at::Tensor& lse, const ChunkTargets& targets,
                        const CrossEntropyTerms& terms) {
  const at::Tensor target_logit = logits.gather(1, targets.safe.unsqueeze(1)).squeeze(1);
  at::Tensor loss = targets.weight * (lse - target_logit);
  if (terms.smoothing > 0) {
    // sum_c w[c] (lse - z[c]) = lse * sum w - z . w
    const int64_t classes = logits.size(1);
    const at::Tensor smooth = terms.class_weights.defined()
                                  ? lse * terms.class_weights.sum() - logits.mv(terms.class_weights)
                                  : lse * static_cast<double>(classes) - logits.sum(1);
    loss = loss * (1.0 - terms.smoothing) + smooth * (terms.smoothing / static_cast<double>(classes));
  }
  return at::where(targets.valid, loss, at::zeros({}, loss.options()));
}

void logits_to_gradient_(at::Tensor& logits, const at::Tensor& lse, const ChunkTargets& targets,
                         const CrossEntropyTerms& terms, const at::Tensor& row_scale) {
  const double e = terms.smoothing;
  const int64_t classes = logits.size(1);
  const at::Tensor scale = at::where(targets.valid, row_scale.to(logits.scalar_type()),
                                     at::zeros({}, logits.options()));
  logits.sub_(lse.unsqueeze(1)).exp_();  // softmax
  // ((1 - e) w[y] + e/V sum w) per row, times the row's scale.
  at::Tensor row = targets.weight * (1.0 - e);
  if (e > 0) {
    const at::Tensor weight_sum = terms.class_weights.defined() ? terms.class_weights.sum()
                                                                : at::full({}, static_cast<double>(classes),
                                                                           logits.options());
    row = row + weight_sum * (e / static_cast<double>(classes));
  }
  logits.mul_((row * scale).unsqueeze(1));
  logits.scatter_add_(1, targets.safe.unsqueeze(1), (targets.weight * scale * -(1.0 - e)).unsqueeze(1));
  if (e > 0) {
    const at::Tensor per_class = terms.class_weights.defined() ? terms.class_weights
                                                               : at::ones({classes}, logits.options());
    logits.addr_(scale, per_class, /*beta=*/1, /*alpha=*/-e / static_cast<double>(classes));
  }
}

}  // namespace amp::detail
