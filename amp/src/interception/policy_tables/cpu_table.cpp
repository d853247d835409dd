// SPDX-License-Identifier: BSD-3-Clause
// amp's default cast policies for CPU tensors (the AutocastCPU key).
//
// The same lists as LibTorch 2.11's native CPU autocast, so O1 on CPU behaves
// exactly like at::autocast; tests/policy_table_test.cpp checks every row
// against native autocast itself. The low-precision dtype is bfloat16 unless
// the user picks float16. The rows every device shares are in
// shared_table.cpp; these are CPU's own.
#include "interception/policy_tables/table_entry.h"

namespace amp::detail {

const std::vector<TableEntry>& cpu_policy_table() {
  static const std::vector<TableEntry> table = with_shared_rows({
      // Lower precision: more convolution overloads, oneDNN's fused GEMM and
      // RNN layer, and native multi-head attention.
      AMP_OP_OVERLOAD(conv1d, padding, kLowerPrecision),
      AMP_OP_OVERLOAD(conv2d, padding, kLowerPrecision),
      AMP_OP_OVERLOAD(conv3d, padding, kLowerPrecision),
      AMP_OP(_addmm_activation, kLowerPrecision),
      AMP_OP_ONEDNN(mkldnn_rnn_layer),  // float32 where oneDNN has no bf16/fp16 RNN
      AMP_OP(_native_multi_head_attention, kLowerPrecision),

      // Float32: pooling and padding without low-precision CPU kernels,
      // reductions, losses, FFTs and linear algebra, whose range or accuracy
      // needs fp32.
      AMP_OP(avg_pool3d, kFp32),
      AMP_OP(binary_cross_entropy, kFp32),
      AMP_OP(grid_sampler, kFp32),
      AMP_OP(polar, kFp32),
      AMP_OP(prod, kFp32),
      AMP_OP_OVERLOAD(prod, dim_int, kFp32),
      AMP_OP_OVERLOAD(prod, dim_Dimname, kFp32),
      AMP_OP(quantile, kFp32),
      AMP_OP_OVERLOAD(quantile, scalar, kFp32),
      AMP_OP(nanquantile, kFp32),
      AMP_OP_OVERLOAD(nanquantile, scalar, kFp32),
      AMP_OP(stft, kFp32),
      AMP_OP_OVERLOAD(stft, center, kFp32),
      AMP_OP(grid_sampler_2d, kFp32),
      AMP_OP(_grid_sampler_2d_cpu_fallback, kFp32),
      AMP_OP(grid_sampler_3d, kFp32),
      AMP_OP(trace, kFp32),
      AMP_OP(view_as_complex, kFp32),
      AMP_OP(cholesky, kFp32),
      AMP_OP(cholesky_inverse, kFp32),
      AMP_OP(cholesky_solve, kFp32),
      AMP_OP(inverse, kFp32),
      AMP_OP(lu_solve, kFp32),
      AMP_OP(orgqr, kFp32),
      AMP_OP(ormqr, kFp32),
      AMP_OP(pinverse, kFp32),
      AMP_OP(max_pool3d, kFp32),
      AMP_OP(max_unpool2d, kFp32),
      AMP_OP(max_unpool3d, kFp32),
      AMP_OP(adaptive_avg_pool3d, kFp32),
      AMP_OP(reflection_pad1d, kFp32),
      AMP_OP(reflection_pad2d, kFp32),
      AMP_OP(replication_pad1d, kFp32),
      AMP_OP(replication_pad2d, kFp32),
      AMP_OP(replication_pad3d, kFp32),
      AMP_OP(cross_entropy_loss, kFp32),
      AMP_OP_OVERLOAD(ctc_loss, IntList, kFp32),
      AMP_OP_OVERLOAD(ctc_loss, Tensor, kFp32),
      AMP_OP(fft_fft, kFp32),
      AMP_OP(fft_ifft, kFp32),
      AMP_OP(fft_fft2, kFp32),
      AMP_OP(fft_ifft2, kFp32),
      AMP_OP(fft_fftn, kFp32),
      AMP_OP(fft_ifftn, kFp32),
      AMP_OP(fft_rfft, kFp32),
      AMP_OP(fft_irfft, kFp32),
      AMP_OP(fft_rfft2, kFp32),
      AMP_OP(fft_irfft2, kFp32),
      AMP_OP(fft_rfftn, kFp32),
      AMP_OP(fft_irfftn, kFp32),
      AMP_OP(fft_hfft, kFp32),
      AMP_OP(fft_ihfft, kFp32),
      AMP_OP(linalg_cond, kFp32),
      AMP_OP_OVERLOAD(linalg_cond, p_str, kFp32),
      AMP_OP(linalg_matrix_rank, kFp32),
      AMP_OP_OVERLOAD(linalg_matrix_rank, tol_tensor, kFp32),
      AMP_OP_OVERLOAD(linalg_matrix_rank, atol_rtol_tensor, kFp32),
      AMP_OP_OVERLOAD(linalg_matrix_rank, atol_rtol_float, kFp32),
      AMP_OP(linalg_solve, kFp32),
      AMP_OP(linalg_cholesky, kFp32),
      AMP_OP(linalg_svdvals, kFp32),
      AMP_OP(linalg_eigvals, kFp32),
      AMP_OP(linalg_eigvalsh, kFp32),
      AMP_OP(linalg_inv, kFp32),
      AMP_OP(linalg_householder_product, kFp32),
      AMP_OP(linalg_tensorinv, kFp32),
      AMP_OP(linalg_tensorsolve, kFp32),
      AMP_OP(fake_quantize_per_tensor_affine, kFp32),
      AMP_OP(geqrf, kFp32),
      AMP_OP(_lu_with_info, kFp32),
      AMP_OP(qr, kFp32),
      AMP_OP(svd, kFp32),
      AMP_OP(triangular_solve, kFp32),
      AMP_OP(fractional_max_pool2d, kFp32),
      AMP_OP(fractional_max_pool3d, kFp32),
      AMP_OP(adaptive_max_pool3d, kFp32),
      AMP_OP(multilabel_margin_loss_forward, kFp32),
      AMP_OP(linalg_qr, kFp32),
      AMP_OP(linalg_cholesky_ex, kFp32),
      AMP_OP(linalg_svd, kFp32),
      AMP_OP(linalg_eig, kFp32),
      AMP_OP(linalg_eigh, kFp32),
      AMP_OP(linalg_lstsq, kFp32),
      AMP_OP(linalg_inv_ex, kFp32),

      // Promote: ops combining several tensors run in the widest dtype.
      AMP_OP(stack, kPromote),
      AMP_OP(cat, kPromote),
      AMP_OP(index_copy, kPromote),
      AMP_OP_OVERLOAD(index_copy, dimname, kPromote),
  });
  return table;
}

}  // namespace amp::detail
