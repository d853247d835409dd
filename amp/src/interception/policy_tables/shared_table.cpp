// SPDX-License-Identifier: BSD-3-Clause
// The rows every device's default table holds, as ATen's autocast_mode.h
// keeps one list per policy (AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32)
// and each device adds its own: cpu_table.cpp and cuda_table.cpp are these
// plus their device's rows. A row here goes to every device; an op whose
// policy differs by device (grid_sampler, prod) stays in each device's table.
#include "interception/policy_tables/table_entry.h"

namespace amp::detail {

const std::vector<TableEntry>& shared_policy_rows() {
  static const std::vector<TableEntry> rows = {
      // Lower precision: convolutions, matrix products and attention.
      AMP_OP(conv1d, kLowerPrecision),
      AMP_OP(conv2d, kLowerPrecision),
      AMP_OP(conv3d, kLowerPrecision),
      AMP_OP(bmm, kLowerPrecision),
      AMP_OP(mm, kLowerPrecision),
      AMP_OP(linalg_vecdot, kLowerPrecision),
      AMP_OP(baddbmm, kLowerPrecision),
      AMP_OP(addmm, kLowerPrecision),
      AMP_OP(addbmm, kLowerPrecision),
      AMP_OP(linear, kLowerPrecision),
      AMP_OP_OVERLOAD(_convolution, deprecated, kLowerPrecision),
      AMP_OP(matmul, kLowerPrecision),
      AMP_OP(conv_tbc, kLowerPrecision),
      AMP_OP(conv_transpose1d, kLowerPrecision),
      AMP_OP_OVERLOAD(conv_transpose2d, input, kLowerPrecision),
      AMP_OP_OVERLOAD(conv_transpose3d, input, kLowerPrecision),
      AMP_OP(prelu, kLowerPrecision),
      AMP_OP(scaled_dot_product_attention, kLowerPrecision),

      // Float32: distances and losses, whose sums and logs need its range.
      AMP_OP(cdist, kFp32),
      AMP_OP(mse_loss, kFp32),
      AMP_OP(cosine_embedding_loss, kFp32),
      AMP_OP(nll_loss, kFp32),
      AMP_OP(nll_loss2d, kFp32),
      AMP_OP(hinge_embedding_loss, kFp32),
      AMP_OP(poisson_nll_loss, kFp32),
      AMP_OP(smooth_l1_loss, kFp32),
      AMP_OP(l1_loss, kFp32),
      AMP_OP(huber_loss, kFp32),
      AMP_OP(margin_ranking_loss, kFp32),
      AMP_OP(soft_margin_loss, kFp32),
      AMP_OP(triplet_margin_loss, kFp32),
      AMP_OP(multi_margin_loss, kFp32),
      AMP_OP(kl_div, kFp32),
      AMP_OP(multilabel_margin_loss, kFp32),
      AMP_OP(binary_cross_entropy_with_logits, kFp32),
  };
  return rows;
}

std::vector<TableEntry> with_shared_rows(std::initializer_list<TableEntry> device_rows) {
  std::vector<TableEntry> table = shared_policy_rows();
  table.insert(table.end(), device_rows.begin(), device_rows.end());
  return table;
}

}  // namespace amp::detail
