// SPDX-License-Identifier: BSD-3-Clause
// amp's default cast policies for CUDA tensors (the AutocastCUDA key).
//
// The same lists as LibTorch 2.11's native CUDA autocast (the AT_FORALL_*
// lists of ATen/autocast_mode.h plus autocast_mode.cpp's extras), and
// aten::_cudnn_rnn, which LibTorch's autocast kernel always runs in float16:
// amp's runs it in the level's dtype (dispatch/cudnn_rnn_cast.cpp).
// Native cat/stack on CUDA already promote mixed inputs, so
// neither table lists them for CUDA (as in LibTorch). The rows every device
// shares are in shared_table.cpp; these are CUDA's own.
#include "interception/policy_tables/table_entry.h"

namespace amp::detail {

const std::vector<TableEntry>& cuda_policy_table() {
  static const std::vector<TableEntry> table = with_shared_rows({
      // Lower precision: tensor-core ops beyond the shared ones (cuDNN's
      // convolutions, GEMV, einsum, RNN cells, flash attention).
      AMP_OP(_convolution, kLowerPrecision),
      AMP_OP(convolution, kLowerPrecision),
      AMP_OP(cudnn_convolution, kLowerPrecision),
      AMP_OP(cudnn_convolution_transpose, kLowerPrecision),
      AMP_OP(addmv, kLowerPrecision),
      AMP_OP(addr, kLowerPrecision),
      AMP_OP(einsum, kLowerPrecision),
      AMP_OP(mv, kLowerPrecision),
      AMP_OP(chain_matmul, kLowerPrecision),
      AMP_OP(linalg_multi_dot, kLowerPrecision),
      AMP_OP(_thnn_fused_lstm_cell, kLowerPrecision),
      AMP_OP(_thnn_fused_gru_cell, kLowerPrecision),
      AMP_OP(lstm_cell, kLowerPrecision),
      AMP_OP(gru_cell, kLowerPrecision),
      AMP_OP(rnn_tanh_cell, kLowerPrecision),
      AMP_OP(rnn_relu_cell, kLowerPrecision),
      AMP_OP(_cudnn_rnn, kLowerPrecision),
      AMP_OP(_scaled_dot_product_flash_attention, kLowerPrecision),

      // Float32: ops whose outputs or intermediate values leave fp16's range
      // (exp, log, pow, ...), normalizations, losses, distances, upsampling.
      AMP_OP(acos, kFp32),
      AMP_OP(asin, kFp32),
      AMP_OP(cosh, kFp32),
      AMP_OP(erfinv, kFp32),
      AMP_OP(exp, kFp32),
      AMP_OP(expm1, kFp32),
      AMP_OP(log, kFp32),
      AMP_OP(log10, kFp32),
      AMP_OP(log2, kFp32),
      AMP_OP(log1p, kFp32),
      AMP_OP(reciprocal, kFp32),
      AMP_OP(rsqrt, kFp32),
      AMP_OP(sinh, kFp32),
      AMP_OP(tan, kFp32),
      AMP_OP_OVERLOAD(pow, Tensor_Scalar, kFp32),
      AMP_OP_OVERLOAD(pow, Tensor_Tensor, kFp32),
      AMP_OP_OVERLOAD(pow, Scalar, kFp32),
      AMP_OP(softplus, kFp32),
      AMP_OP(layer_norm, kFp32),
      AMP_OP(native_layer_norm, kFp32),
      AMP_OP(group_norm, kFp32),
      AMP_OP_OVERLOAD(frobenius_norm, dim, kFp32),
      AMP_OP(nuclear_norm, kFp32),
      AMP_OP_OVERLOAD(nuclear_norm, dim, kFp32),
      AMP_OP(cosine_similarity, kFp32),
      AMP_OP(dist, kFp32),
      AMP_OP(pdist, kFp32),
      AMP_OP(renorm, kFp32),
      AMP_OP(logsumexp, kFp32),
      AMP_OP(upsample_nearest1d, kFp32),
      AMP_OP(_upsample_nearest_exact1d, kFp32),
      AMP_OP(upsample_nearest2d, kFp32),
      AMP_OP(_upsample_nearest_exact2d, kFp32),
      AMP_OP(upsample_nearest3d, kFp32),
      AMP_OP(_upsample_nearest_exact3d, kFp32),
      AMP_OP(upsample_linear1d, kFp32),
      AMP_OP(upsample_bilinear2d, kFp32),
      AMP_OP(_upsample_bilinear2d_aa, kFp32),
      AMP_OP(upsample_trilinear3d, kFp32),
      AMP_OP(upsample_bicubic2d, kFp32),
      AMP_OP(_upsample_bicubic2d_aa, kFp32),

      // Float32 through the op's dtype argument: reductions and softmax keep
      // their inputs and accumulate and return fp32.
      AMP_OP(prod, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(prod, dim_int, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(prod, dim_Dimname, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(softmax, int, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(softmax, Dimname, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(log_softmax, int, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(log_softmax, Dimname, kFp32SetOptDtype),
      AMP_OP(cumprod, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(cumprod, dimname, kFp32SetOptDtype),
      AMP_OP(cumsum, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(cumsum, dimname, kFp32SetOptDtype),
      AMP_OP(linalg_vector_norm, kFp32SetOptDtype),
      AMP_OP(linalg_matrix_norm, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(linalg_matrix_norm, str_ord, kFp32SetOptDtype),
      AMP_OP(sum, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(sum, dim_IntList, kFp32SetOptDtype),
      AMP_OP_OVERLOAD(sum, dim_DimnameList, kFp32SetOptDtype),

      // Float32 through the overload that takes a dtype (norm has no dtype
      // argument in these overloads).
      AMP_OP_APPEND_DTYPE(norm, Scalar, ScalarOpt_dtype),
      AMP_OP_APPEND_DTYPE(norm, ScalarOpt_dim, ScalarOpt_dim_dtype),
      AMP_OP_APPEND_DTYPE(norm, names_ScalarOpt_dim, names_ScalarOpt_dim_dtype),

      // Promote: ops combining several tensors run in the widest dtype.
      AMP_OP(addcdiv, kPromote),
      AMP_OP(addcmul, kPromote),
      AMP_OP(atan2, kPromote),
      AMP_OP(bilinear, kPromote),
      AMP_OP(cross, kPromote),
      AMP_OP(dot, kPromote),
      AMP_OP(vdot, kPromote),
      AMP_OP(grid_sampler, kPromote),
      AMP_OP(index_put, kPromote),
      AMP_OP(tensordot, kPromote),
      AMP_OP(scatter_add, kPromote),

      // Banned: the sigmoid before binary_cross_entropy saturates in fp16 and
      // its log underflows; binary_cross_entropy_with_logits fuses both safely.
      AMP_OP_BANNED(binary_cross_entropy,
                    "Many models apply a sigmoid right before binary_cross_entropy; in low precision "
                    "the sigmoid saturates and the log underflows. Combine the two with "
                    "torch::binary_cross_entropy_with_logits (torch::nn::BCEWithLogitsLoss), which is "
                    "safe under amp."),
  });
  return table;
}

}  // namespace amp::detail
