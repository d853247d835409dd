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

namespace {

// Whether each row's target lies in `window`.
at::Tensor in_window_of(const ClassWindow& window, const ChunkTargets& targets) {
  return targets.safe.ge(window.begin).logical_and_(targets.safe.lt(window.end));
}

// Each row's target as a column of `window` (clamped into it for the rows
// whose target lies outside, which read or add nothing).
at::Tensor window_index(const ClassWindow& window, const ChunkTargets& targets) {
  return (targets.safe - window.begin).clamp_(0, window.width() - 1);
}

// The target's logit of the rows whose target lies in `window`, 0 for the others.
at::Tensor window_target_logits(const at::Tensor& logits, const ClassWindow& window, const ChunkTargets& targets) {
  const at::Tensor z = logits.gather(1, window_index(window, targets).unsqueeze(1)).squeeze(1);
  return at::where(in_window_of(window, targets), z, at::zeros({}, z.options()));
}

}  // namespace

void LogitSums::add(const at::Tensor& logits, const ClassWindow& window, const ChunkTargets& targets,
                    const CrossEntropyTerms& terms) {
  at::Tensor target = window.whole() ? logits.gather(1, targets.safe.unsqueeze(1)).squeeze(1)
                                     : window_target_logits(logits, window, targets);
  target_logit = target_logit.defined() ? target_logit.add_(target) : target;
  if (terms.smoothing > 0) {
    const at::Tensor dot = terms.class_weights.defined()
                               ? logits.mv(window.rows_of(terms.class_weights))
                               : logits.sum(1);
    weighted = weighted.defined() ? weighted.add_(dot) : dot;
  }
}

at::Tensor token_losses(const at::Tensor& lse, const LogitSums& sums, const ChunkTargets& targets,
                        const CrossEntropyTerms& terms, int64_t classes) {
  at::Tensor loss = targets.weight * (lse - sums.target_logit);
  if (terms.smoothing > 0) {
    // sum_c w[c] (lse - z[c]) = lse * sum w - z . w
    const at::Tensor smooth = terms.class_weights.defined() ? lse * terms.class_weights.sum() - sums.weighted
                                                            : lse * static_cast<double>(classes) - sums.weighted;
    loss = loss * (1.0 - terms.smoothing) + smooth * (terms.smoothing / static_cast<double>(classes));
  }
  return at::where(targets.valid, loss, at::zeros({}, loss.options()));
}

void logits_to_gradient_(at::Tensor& logits, const ClassWindow& window, const at::Tensor& lse,
                         const ChunkTargets& targets, const CrossEntropyTerms& terms, const at::Tensor& row_scale) {
  const double e = terms.smoothing;
  const int64_t classes = window.classes;
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
  at::Tensor target_term = targets.weight * scale * -(1.0 - e);
  if (window.whole()) {
    logits.scatter_add_(1, targets.safe.unsqueeze(1), target_term.unsqueeze(1));
  } else {  // only the rows whose target is in the window
    const at::Tensor in_window = in_window_of(window, targets);
    logits.scatter_add_(1, window_index(window, targets).unsqueeze(1),
                        at::where(in_window, target_term, at::zeros({}, target_term.options())).unsqueeze(1));
  }
  if (e > 0) {
    const at::Tensor per_class = terms.class_weights.defined() ? window.rows_of(terms.class_weights)
                                                               : at::ones({window.width()}, logits.options());
    logits.addr_(scale, per_class, /*beta=*/1, /*alpha=*/-e / static_cast<double>(classes));
  }
}

}  // namespace amp::detail
