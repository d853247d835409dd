// SPDX-License-Identifier: BSD-3-Clause
// The default policy tables against LibTorch's native autocast.
//
// Coverage: the ops amp intercepts per device are exactly the ops LibTorch
// 2.11 registers autocast kernels for. Behaviour: every op of the CPU table,
// in bfloat16 and float16, gives the same output dtypes and bit-identical
// values under amp O1, under native at::autocast, and in a control run on
// inputs pre-cast by hand per the table's policy; gradients come back in
// their inputs' dtypes.
#include "test_util.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <functional>
#include <set>

namespace amp::testing {
namespace {

std::set<std::string> ops_with_native_kernel(c10::DispatchKey key) {
  std::set<std::string> names;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    auto op = dispatcher.findOp(name);
    if (op && op->hasKernelForDispatchKey(key)) {
      names.insert(name.overload_name.empty() ? name.name : name.name + "." + name.overload_name);
    }
  }
  return names;
}

std::set<std::string> table_ops(c10::DeviceType device) {
  std::set<std::string> names;
  for (const auto& row : policy_table(device)) names.insert(row.op);
  return names;
}

TEST(PolicyTableCoverage, CpuTableIsExactlyNativeAutocastCpu) {
  ASSERT_FALSE(amp::is_initialized());
  EXPECT_EQ(table_ops(c10::kCPU), ops_with_native_kernel(c10::DispatchKey::AutocastCPU));
}

TEST(PolicyTableCoverage, CudaTableIsExactlyNativeAutocastCuda) {
  ASSERT_FALSE(amp::is_initialized());
  EXPECT_EQ(table_ops(c10::kCUDA), ops_with_native_kernel(c10::DispatchKey::AutocastCUDA));
}

TEST(PolicyTableCoverage, CudaPoliciesMatchTheInstalledAutocastHeaderLists) {
  // ATen/autocast_mode.h's AT_FORALL_* lists are LibTorch's CUDA policy.
  std::map<std::string, CastPolicy> expected;
#define AMP_EXPECT_ROW(policy, op, ...) expected["aten::" #op __VA_OPT__("." #__VA_ARGS__)] = policy;
#define AMP_LOWER(...) AMP_EXPECT_ROW(CastPolicy::kLowerPrecision, __VA_ARGS__)
#define AMP_FP32(...) AMP_EXPECT_ROW(CastPolicy::kFp32, __VA_ARGS__)
#define AMP_SET_DTYPE(...) AMP_EXPECT_ROW(CastPolicy::kFp32SetOptDtype, __VA_ARGS__)
#define AMP_PROMOTE(...) AMP_EXPECT_ROW(CastPolicy::kPromote, __VA_ARGS__)
  AT_FORALL_LOWER_PRECISION_FP(AMP_LOWER)
  AT_FORALL_FP32(AMP_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(AMP_SET_DTYPE)
  AT_FORALL_PROMOTE(AMP_PROMOTE)
  expected["aten::cudnn_convolution"] = CastPolicy::kLowerPrecision;
  expected["aten::cudnn_convolution_transpose"] = CastPolicy::kLowerPrecision;
  expected["aten::norm.Scalar"] = CastPolicy::kFp32AppendDtype;
  expected["aten::norm.ScalarOpt_dim"] = CastPolicy::kFp32AppendDtype;
  expected["aten::norm.names_ScalarOpt_dim"] = CastPolicy::kFp32AppendDtype;
  expected["aten::binary_cross_entropy"] = CastPolicy::kBanned;
  expected["aten::_cudnn_rnn"] = CastPolicy::kLowerPrecision;  // AutocastRNN.cpp's kernel
  std::map<std::string, CastPolicy> actual;
  for (const auto& row : policy_table(c10::kCUDA)) actual[row.op] = row.policy;
  EXPECT_EQ(actual, expected);
}

// --- Per-op comparison on CPU -------------------------------------------------

// Makes sample inputs: `x` in the dtype the policy acts on (fp32 for the
// lower-precision list, the low dtype otherwise), `f` always fp32.
struct Make {
  at::ScalarType x_dtype;
  at::Tensor x(at::IntArrayRef shape) const { return torch::randn(shape).to(x_dtype); }
  at::Tensor pos(at::IntArrayRef shape) const { return (torch::rand(shape) + 0.5).to(x_dtype); }
  at::Tensor unit(at::IntArrayRef shape) const { return (torch::rand(shape) * 0.9 + 0.05).to(x_dtype); }
  at::Tensor f(at::IntArrayRef shape) const { return torch::randn(shape); }
  at::Tensor as_x(const at::Tensor& t) const { return t.to(x_dtype); }
  // Well conditioned, symmetric positive definite and upper triangular matrices.
  at::Tensor well(int64_t n) const { return as_x(torch::randn({n, n}) + n * torch::eye(n)); }
  at::Tensor spd(int64_t n) const {
    auto a = torch::randn({n, n});
    return as_x(a.mm(a.t()) + n * torch::eye(n));
  }
  at::Tensor sym(int64_t n) const {
    auto a = torch::randn({n, n});
    return as_x(a + a.t());
  }
  at::Tensor signs(int64_t n) const { return as_x(torch::randint(0, 2, {n}) * 2 - 1); }
  static at::Tensor longs(std::vector<int64_t> values) { return torch::tensor(values); }
};

using Args = std::vector<c10::IValue>;
struct Sample {
  std::string op;
  std::function<Args(const Make&)> args;
};

std::vector<Sample> cpu_samples() {
  auto lu = [](const Make& m) { return at::linalg_lu_factor(m.well(4).to(at::kFloat)); };
  auto qr = [](const Make& m, int64_t rows, int64_t cols) {
    return at::geqrf(torch::randn({rows, cols}));
  };
  using L = std::vector<int64_t>;
  return {
      // Lower precision.
      {"aten::conv1d", [](const Make& m) { return Args{m.x({2, 3, 8}), m.x({4, 3, 3}), m.x({4})}; }},
      {"aten::conv1d.padding", [](const Make& m) { return Args{m.x({2, 3, 8}), m.x({4, 3, 3}), m.x({4}), L{1}, "same"}; }},
      {"aten::conv2d", [](const Make& m) { return Args{m.x({2, 3, 6, 6}), m.x({4, 3, 3, 3}), m.x({4})}; }},
      {"aten::conv2d.padding", [](const Make& m) { return Args{m.x({2, 3, 6, 6}), m.x({4, 3, 3, 3}), m.x({4}), L{1, 1}, "same"}; }},
      {"aten::conv3d", [](const Make& m) { return Args{m.x({1, 2, 4, 4, 4}), m.x({3, 2, 2, 2, 2}), m.x({3})}; }},
      {"aten::conv3d.padding", [](const Make& m) { return Args{m.x({1, 2, 4, 4, 4}), m.x({3, 2, 3, 3, 3}), m.x({3}), L{1, 1, 1}, "same"}; }},
      {"aten::bmm", [](const Make& m) { return Args{m.x({2, 3, 4}), m.x({2, 4, 5})}; }},
      {"aten::mm", [](const Make& m) { return Args{m.x({3, 4}), m.x({4, 5})}; }},
      {"aten::linalg_vecdot", [](const Make& m) { return Args{m.x({3, 4}), m.x({3, 4})}; }},
      {"aten::baddbmm", [](const Make& m) { return Args{m.x({2, 3, 5}), m.x({2, 3, 4}), m.x({2, 4, 5})}; }},
      {"aten::addmm", [](const Make& m) { return Args{m.x({3, 5}), m.x({3, 4}), m.x({4, 5})}; }},
      {"aten::_addmm_activation", [](const Make& m) { return Args{m.x({3, 5}), m.x({3, 4}), m.x({4, 5})}; }},
      {"aten::addbmm", [](const Make& m) { return Args{m.x({3, 5}), m.x({2, 3, 4}), m.x({2, 4, 5})}; }},
      {"aten::linear", [](const Make& m) { return Args{m.x({2, 4}), m.x({3, 4}), m.x({3})}; }},
      {"aten::_convolution.deprecated", [](const Make& m) {
         return Args{m.x({1, 2, 5, 5}), m.x({3, 2, 3, 3}), m.x({3}), L{1, 1}, L{0, 0}, L{1, 1}, false, L{0, 0}, 1, false, false, false};
       }},
      {"aten::matmul", [](const Make& m) { return Args{m.x({3, 4}), m.x({4, 5})}; }},
      {"aten::conv_tbc", [](const Make& m) { return Args{m.x({5, 2, 3}), m.x({3, 3, 4}), m.x({4}), 1}; }},
      {"aten::mkldnn_rnn_layer", [](const Make& m) {
         // One LSTM layer (mode 2), hidden 3, input 4, sequence 5, batch 2.
         return Args{m.x({5, 2, 4}), m.x({12, 4}), m.x({12, 3}), m.x({12}), m.x({12}), m.x({2, 3}), m.x({2, 3}),
                     false, L{}, 2, 3, 1, true, false, false, false};
       }},
      {"aten::conv_transpose1d", [](const Make& m) { return Args{m.x({1, 3, 5}), m.x({3, 2, 3}), m.x({2})}; }},
      {"aten::conv_transpose2d.input", [](const Make& m) { return Args{m.x({1, 3, 4, 4}), m.x({3, 2, 3, 3}), m.x({2})}; }},
      {"aten::conv_transpose3d.input", [](const Make& m) { return Args{m.x({1, 2, 3, 3, 3}), m.x({2, 2, 2, 2, 2}), m.x({2})}; }},
      {"aten::prelu", [](const Make& m) { return Args{m.x({2, 3, 4}), m.x({3})}; }},
      {"aten::scaled_dot_product_attention", [](const Make& m) { return Args{m.x({2, 2, 4, 8}), m.x({2, 2, 4, 8}), m.x({2, 2, 4, 8})}; }},
      {"aten::_native_multi_head_attention", [](const Make& m) {
         return Args{m.x({2, 3, 4}), m.x({2, 3, 4}), m.x({2, 3, 4}), 4, 2, m.x({12, 4}), m.x({12}), m.x({4, 4}), m.x({4})};
       }},
      // Float32.
      {"aten::avg_pool3d", [](const Make& m) { return Args{m.x({1, 2, 4, 4, 4}), L{2, 2, 2}}; }},
      {"aten::binary_cross_entropy", [](const Make& m) { return Args{m.unit({4}), m.unit({4})}; }},
      {"aten::grid_sampler", [](const Make& m) { return Args{m.x({1, 2, 4, 4}), m.as_x(torch::rand({1, 3, 3, 2}) * 2 - 1), 0, 0, false}; }},
      {"aten::polar", [](const Make& m) { return Args{m.pos({4}), m.x({4})}; }},
      {"aten::prod", [](const Make& m) { return Args{m.pos({3, 4})}; }},
      {"aten::prod.dim_int", [](const Make& m) { return Args{m.pos({3, 4}), 1}; }},
      {"aten::quantile", [](const Make& m) { return Args{m.x({10}), m.as_x(torch::tensor({0.25, 0.5}))}; }},
      {"aten::quantile.scalar", [](const Make& m) { return Args{m.x({10}), 0.3}; }},
      {"aten::nanquantile", [](const Make& m) { return Args{m.x({10}), m.as_x(torch::tensor({0.25, 0.5}))}; }},
      {"aten::nanquantile.scalar", [](const Make& m) { return Args{m.x({10}), 0.3}; }},
      {"aten::stft", [](const Make& m) {
         return Args{m.x({64}), 16, c10::IValue(), c10::IValue(), c10::IValue(), false, c10::IValue(), true};
       }},
      {"aten::stft.center", [](const Make& m) {
         return Args{m.x({64}), 16, c10::IValue(), c10::IValue(), c10::IValue(), true, "reflect", false, c10::IValue(), true};
       }},
      {"aten::cdist", [](const Make& m) { return Args{m.x({3, 4}), m.x({5, 4})}; }},
      {"aten::grid_sampler_2d", [](const Make& m) { return Args{m.x({1, 2, 4, 4}), m.as_x(torch::rand({1, 3, 3, 2}) * 2 - 1), 0, 0, false}; }},
      {"aten::_grid_sampler_2d_cpu_fallback", [](const Make& m) { return Args{m.x({1, 2, 4, 4}), m.as_x(torch::rand({1, 3, 3, 2}) * 2 - 1), 0, 0, false}; }},
      {"aten::grid_sampler_3d", [](const Make& m) { return Args{m.x({1, 2, 3, 3, 3}), m.as_x(torch::rand({1, 2, 2, 2, 3}) * 2 - 1), 0, 0, false}; }},
      {"aten::trace", [](const Make& m) { return Args{m.x({4, 4})}; }},
      {"aten::view_as_complex", [](const Make& m) { return Args{m.x({3, 2})}; }},
      {"aten::cholesky", [](const Make& m) { return Args{m.spd(4)}; }},
      {"aten::cholesky_inverse", [](const Make& m) { return Args{m.as_x(torch::linalg_cholesky(m.spd(4).to(at::kFloat)))}; }},
      {"aten::cholesky_solve", [](const Make& m) { return Args{m.x({4, 2}), m.as_x(torch::linalg_cholesky(m.spd(4).to(at::kFloat)))}; }},
      {"aten::inverse", [](const Make& m) { return Args{m.well(4)}; }},
      {"aten::lu_solve", [&](const Make& m) {
         auto [factors, pivots] = lu(m);
         return Args{m.x({4, 2}), m.as_x(factors), pivots};
       }},
      {"aten::orgqr", [&](const Make& m) {
         auto [a, tau] = qr(m, 4, 3);
         return Args{m.as_x(a), m.as_x(tau)};
       }},
      {"aten::ormqr", [&](const Make& m) {
         auto [a, tau] = qr(m, 4, 3);
         return Args{m.as_x(a), m.as_x(tau), m.x({4, 2})};
       }},
      {"aten::pinverse", [](const Make& m) { return Args{m.x({4, 3})}; }},
      {"aten::max_pool3d", [](const Make& m) { return Args{m.x({1, 2, 4, 4, 4}), L{2, 2, 2}}; }},
      {"aten::max_unpool2d", [](const Make& m) {
         auto [out, indices] = at::max_pool2d_with_indices(torch::randn({1, 2, 4, 4}), {2, 2});
         return Args{m.as_x(out), indices, L{4, 4}};
       }},
      {"aten::max_unpool3d", [](const Make& m) {
         auto [out, indices] = at::max_pool3d_with_indices(torch::randn({1, 2, 4, 4, 4}), {2, 2, 2});
         return Args{m.as_x(out), indices, L{4, 4, 4}, L{2, 2, 2}, L{0, 0, 0}};
       }},
      {"aten::adaptive_avg_pool3d", [](const Make& m) { return Args{m.x({1, 2, 4, 4, 4}), L{2, 2, 2}}; }},
      {"aten::reflection_pad1d", [](const Make& m) { return Args{m.x({1, 2, 5}), L{2, 2}}; }},
      {"aten::reflection_pad2d", [](const Make& m) { return Args{m.x({1, 2, 5, 5}), L{1, 1, 1, 1}}; }},
      {"aten::replication_pad1d", [](const Make& m) { return Args{m.x({1, 2, 5}), L{2, 2}}; }},
      {"aten::replication_pad2d", [](const Make& m) { return Args{m.x({1, 2, 5, 5}), L{1, 1, 1, 1}}; }},
      {"aten::replication_pad3d", [](const Make& m) { return Args{m.x({1, 2, 3, 3, 3}), L{1, 1, 1, 1, 1, 1}}; }},
      {"aten::mse_loss", [](const Make& m) { return Args{m.x({4}), m.x({4})}; }},
      {"aten::cosine_embedding_loss", [](const Make& m) { return Args{m.x({3, 4}), m.x({3, 4}), m.signs(3)}; }},
      {"aten::nll_loss", [](const Make& m) { return Args{m.as_x(torch::log_softmax(torch::randn({3, 5}), 1)), Make::longs({0, 4, 2})}; }},
      {"aten::nll_loss2d", [](const Make& m) {
         return Args{m.as_x(torch::log_softmax(torch::randn({2, 3, 4, 4}), 1)), torch::randint(0, 3, {2, 4, 4})};
       }},
      {"aten::hinge_embedding_loss", [](const Make& m) { return Args{m.x({4}), m.signs(4)}; }},
      {"aten::poisson_nll_loss", [](const Make& m) { return Args{m.x({4}), m.pos({4}), true, false, 1e-8, 1}; }},
      {"aten::smooth_l1_loss", [](const Make& m) { return Args{m.x({4}), m.x({4})}; }},
      {"aten::cross_entropy_loss", [](const Make& m) { return Args{m.x({3, 5}), Make::longs({0, 4, 2})}; }},
      {"aten::l1_loss", [](const Make& m) { return Args{m.x({4}), m.x({4})}; }},
      {"aten::huber_loss", [](const Make& m) { return Args{m.x({4}), m.x({4})}; }},
      {"aten::margin_ranking_loss", [](const Make& m) { return Args{m.x({4}), m.x({4}), m.signs(4)}; }},
      {"aten::soft_margin_loss", [](const Make& m) { return Args{m.x({4}), m.signs(4)}; }},
      {"aten::triplet_margin_loss", [](const Make& m) { return Args{m.x({3, 4}), m.x({3, 4}), m.x({3, 4})}; }},
      {"aten::multi_margin_loss", [](const Make& m) { return Args{m.x({3, 5}), Make::longs({0, 4, 2})}; }},
      {"aten::ctc_loss.IntList", [](const Make& m) {
         return Args{m.as_x(torch::log_softmax(torch::randn({6, 2, 4}), 2)), Make::longs({1, 2, 3, 1, 2, 3}).view({2, 3}), L{6, 6}, L{3, 2}};
       }},
      {"aten::ctc_loss.Tensor", [](const Make& m) {
         return Args{m.as_x(torch::log_softmax(torch::randn({6, 2, 4}), 2)), Make::longs({1, 2, 3, 1, 2, 3}).view({2, 3}),
                     Make::longs({6, 6}), Make::longs({3, 2})};
       }},
      {"aten::kl_div", [](const Make& m) { return Args{m.as_x(torch::log_softmax(torch::randn({4}), 0)), m.as_x(torch::softmax(torch::randn({4}), 0))}; }},
      {"aten::multilabel_margin_loss", [](const Make& m) { return Args{m.x({2, 4}), Make::longs({3, 0, -1, 1, 0, 1, 2, 3}).view({2, 4})}; }},
      {"aten::multilabel_margin_loss_forward", [](const Make& m) { return Args{m.x({2, 4}), Make::longs({3, 0, -1, 1, 0, 1, 2, 3}).view({2, 4}), 1}; }},
      {"aten::binary_cross_entropy_with_logits", [](const Make& m) { return Args{m.x({4}), m.unit({4})}; }},
      {"aten::fft_fft", [](const Make& m) { return Args{m.x({8})}; }},
      {"aten::fft_ifft", [](const Make& m) { return Args{m.x({8})}; }},
      {"aten::fft_fft2", [](const Make& m) { return Args{m.x({4, 4})}; }},
      {"aten::fft_ifft2", [](const Make& m) { return Args{m.x({4, 4})}; }},
      {"aten::fft_fftn", [](const Make& m) { return Args{m.x({2, 4, 4})}; }},
      {"aten::fft_ifftn", [](const Make& m) { return Args{m.x({2, 4, 4})}; }},
      {"aten::fft_rfft", [](const Make& m) { return Args{m.x({8})}; }},
      {"aten::fft_irfft", [](const Make& m) { return Args{m.x({8})}; }},
      {"aten::fft_rfft2", [](const Make& m) { return Args{m.x({4, 4})}; }},
      {"aten::fft_irfft2", [](const Make& m) { return Args{m.x({4, 4})}; }},
      {"aten::fft_rfftn", [](const Make& m) { return Args{m.x({2, 4, 4})}; }},
      {"aten::fft_irfftn", [](const Make& m) { return Args{m.x({2, 4, 4})}; }},
      {"aten::fft_hfft", [](const Make& m) { return Args{m.x({8})}; }},
      {"aten::fft_ihfft", [](const Make& m) { return Args{m.x({8})}; }},
      {"aten::linalg_cond", [](const Make& m) { return Args{m.well(4)}; }},
      {"aten::linalg_cond.p_str", [](const Make& m) { return Args{m.well(4), "fro"}; }},
      {"aten::linalg_matrix_rank", [](const Make& m) { return Args{m.well(4), 1e-3}; }},
      {"aten::linalg_matrix_rank.tol_tensor", [](const Make& m) { return Args{m.well(4), m.as_x(torch::tensor(1e-3))}; }},
      {"aten::linalg_matrix_rank.atol_rtol_tensor", [](const Make& m) { return Args{m.well(4)}; }},
      {"aten::linalg_matrix_rank.atol_rtol_float", [](const Make& m) { return Args{m.well(4)}; }},
      {"aten::linalg_solve", [](const Make& m) { return Args{m.well(4), m.x({4, 2})}; }},
      {"aten::linalg_cholesky", [](const Make& m) { return Args{m.spd(4)}; }},
      {"aten::linalg_svdvals", [](const Make& m) { return Args{m.x({4, 3})}; }},
      {"aten::linalg_eigvals", [](const Make& m) { return Args{m.well(4)}; }},
      {"aten::linalg_eigvalsh", [](const Make& m) { return Args{m.sym(4)}; }},
      {"aten::linalg_inv", [](const Make& m) { return Args{m.well(4)}; }},
      {"aten::linalg_householder_product", [&](const Make& m) {
         auto [a, tau] = qr(m, 4, 3);
         return Args{m.as_x(a), m.as_x(tau)};
       }},
      {"aten::linalg_tensorinv", [](const Make& m) { return Args{m.well(4).view({4, 2, 2}), 1}; }},
      {"aten::linalg_tensorsolve", [](const Make& m) { return Args{m.well(6).view({6, 2, 3}), m.x({6})}; }},
      {"aten::fake_quantize_per_tensor_affine", [](const Make& m) { return Args{m.x({4}), 0.1, 0, 0, 255}; }},
      {"aten::geqrf", [](const Make& m) { return Args{m.x({4, 3})}; }},
      {"aten::_lu_with_info", [](const Make& m) { return Args{m.well(4)}; }},
      {"aten::qr", [](const Make& m) { return Args{m.x({4, 3})}; }},
      {"aten::svd", [](const Make& m) { return Args{m.x({4, 3})}; }},
      {"aten::triangular_solve", [](const Make& m) { return Args{m.x({4, 2}), m.as_x(torch::triu(m.well(4).to(at::kFloat)))}; }},
      {"aten::fractional_max_pool2d", [](const Make& m) { return Args{m.x({1, 2, 6, 6}), L{2, 2}, L{3, 3}, m.as_x(torch::rand({1, 2, 2}))}; }},
      {"aten::fractional_max_pool3d", [](const Make& m) { return Args{m.x({1, 2, 6, 6, 6}), L{2, 2, 2}, L{3, 3, 3}, m.as_x(torch::rand({1, 2, 3}))}; }},
      {"aten::adaptive_max_pool3d", [](const Make& m) { return Args{m.x({1, 2, 4, 4, 4}), L{2, 2, 2}}; }},
      {"aten::linalg_qr", [](const Make& m) { return Args{m.x({4, 3})}; }},
      {"aten::linalg_cholesky_ex", [](const Make& m) { return Args{m.spd(4)}; }},
      {"aten::linalg_svd", [](const Make& m) { return Args{m.x({4, 3})}; }},
      {"aten::linalg_eig", [](const Make& m) { return Args{m.well(4)}; }},
      {"aten::linalg_eigh", [](const Make& m) { return Args{m.sym(4)}; }},
      {"aten::linalg_lstsq", [](const Make& m) { return Args{m.x({5, 3}), m.x({5, 2})}; }},
      {"aten::linalg_inv_ex", [](const Make& m) { return Args{m.well(4)}; }},
      // Promote: mixed low-precision and fp32 inputs.
      {"aten::stack", [](const Make& m) { return Args{std::vector<at::Tensor>{m.x({2, 3}), m.f({2, 3})}}; }},
      {"aten::cat", [](const Make& m) { return Args{std::vector<at::Tensor>{m.x({2, 3}), m.f({2, 3}), m.x({1, 3})}}; }},
      {"aten::index_copy", [](const Make& m) { return Args{m.x({4, 3}), 0, Make::longs({0, 2}), m.f({2, 3})}; }},
  };
}

// Ops without a CPU sample, with the reason; each still appears in the table
// (checked by the coverage test) and is intercepted like its siblings.
const std::map<std::string, std::string>& cpu_exemptions() {
  static const std::map<std::string, std::string> exemptions = {
      {"aten::prod.dim_Dimname", "named-tensor overload; aten::prod.dim_int runs the same kernel"},
      {"aten::index_copy.dimname", "named-tensor overload; aten::index_copy runs the same kernel"},
  };
  return exemptions;
}

// Ops whose CPU kernel is not bit-reproducible even between two native calls
// on identical inputs (LAPACK gelsy's result varies from call to call here);
// compared to 1e-5 relative instead of bit for bit.
bool nondeterministic(const std::string& op) { return op == "aten::linalg_lstsq"; }

::testing::AssertionResult Same(const std::string& op, const at::Tensor& a, const at::Tensor& b) {
  if (!nondeterministic(op)) return BitEqual(a, b);
  if (a.scalar_type() == b.scalar_type() && torch::allclose(a, b, 1e-5, 1e-6)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "not close: " << a << " vs " << b;
}

// Outputs that are scratch memory rather than results: oneDNN's RNN
// workspace (output 3 of mkldnn_rnn_layer) holds uninitialized bytes.
bool is_scratch_output(const std::string& op, size_t index) {
  return op == "aten::mkldnn_rnn_layer" && index == 3;
}

// LibTorch's deprecation warnings for legacy linalg ops would flood the log.
class DropWarnings final : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

TEST(PolicyTableCpu, EveryOpHasASampleOrADocumentedExemption) {
  std::set<std::string> covered;
  for (const auto& s : cpu_samples()) covered.insert(s.op);
  for (const auto& [op, why] : cpu_exemptions()) covered.insert(op);
  EXPECT_EQ(covered, table_ops(c10::kCPU));
}

// Runs `op` boxed on `args`, filling the remaining arguments with the schema's
// defaults; returns the tensor outputs (tuples flattened).
std::vector<at::Tensor> run_boxed(const std::string& op_name, Args args) {
  const auto dot = op_name.find('.');
  const c10::OperatorName name(op_name.substr(0, dot),
                               dot == std::string::npos ? "" : op_name.substr(dot + 1));
  auto op = c10::Dispatcher::singleton().findOp(name);
  const auto& schema = op->schema();
  for (size_t i = args.size(); i < schema.arguments().size(); ++i) {
    const auto& arg = schema.arguments()[i];
    TORCH_CHECK(arg.default_value().has_value(), "sample for ", op_name, " lacks argument ",
                arg.name());
    args.push_back(*arg.default_value());
  }
  torch::jit::Stack stack(args.begin(), args.end());
  op->callBoxed(&stack);
  std::vector<at::Tensor> outputs;
  for (const auto& v : stack) {
    if (v.isTensor()) outputs.push_back(v.toTensor());
    if (v.isTuple()) {
      for (const auto& e : v.toTupleRef().elements()) {
        if (e.isTensor()) outputs.push_back(e.toTensor());
      }
    }
  }
  return outputs;
}

// The control: inputs cast by hand per `policy`, op run without autocast.
Args precast(Args args, CastPolicy policy, at::ScalarType low) {
  auto floating = [](const at::Tensor& t) {
    return t.defined() && t.is_floating_point() && t.scalar_type() != at::kDouble;
  };
  at::ScalarType to = policy == CastPolicy::kLowerPrecision ? low : at::kFloat;
  if (policy == CastPolicy::kPromote) {
    to = low;
    for (const auto& v : args) {
      for (const auto& t : v.isTensorList() ? v.toTensorVector()
                                            : (v.isTensor() ? std::vector<at::Tensor>{v.toTensor()}
                                                            : std::vector<at::Tensor>{})) {
        if (floating(t) && t.scalar_type() == at::kFloat) to = at::kFloat;
      }
    }
  }
  for (auto& v : args) {
    if (v.isTensor() && floating(v.toTensor())) v = v.toTensor().to(to);
    if (v.isTensorList()) {
      std::vector<at::Tensor> list = v.toTensorVector();
      for (auto& t : list) {
        if (floating(t)) t = t.to(to);
      }
      v = list;
    }
  }
  return args;
}

std::vector<at::Tensor> floating_inputs(const Args& args) {
  std::vector<at::Tensor> out;
  for (const auto& v : args) {
    std::vector<at::Tensor> tensors;
    if (v.isTensor()) tensors.push_back(v.toTensor());
    if (v.isTensorList()) tensors = v.toTensorVector();
    for (const auto& t : tensors) {
      if (t.is_floating_point()) out.push_back(t);
    }
  }
  return out;
}

Args with_grad(Args args) {
  for (const at::Tensor& t : floating_inputs(args)) t.requires_grad_(true);
  return args;
}

// Backpropagates a sum of every differentiable output; false when the op
// has no derivative.
bool backward_succeeds(const std::vector<at::Tensor>& outputs) {
  at::Tensor loss;
  for (const auto& o : outputs) {
    if (!o.requires_grad()) continue;
    const at::Tensor term = o.is_complex() ? at::view_as_real(o.resolve_conj()).sum() : o.to(at::kFloat).sum();
    loss = loss.defined() ? loss + term : term;
  }
  if (!loss.defined()) return false;
  try {
    loss.backward();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

struct Outcome {
  std::vector<at::Tensor> outputs;
  std::string error;  // set when the op has no CPU kernel for the dtype
};

Outcome attempt(const std::function<std::vector<at::Tensor>()>& run) {
  try {
    return {run(), ""};
  } catch (const c10::Error& e) {
    return {{}, e.what_without_backtrace()};
  } catch (const std::exception& e) {  // oneDNN reports missing kernels with its own type
    return {{}, e.what()};
  }
}

class PolicyTableCpuOp : public ::testing::TestWithParam<at::ScalarType> {};

// Rows whose low-precision kernel is oneDNN's alone (AMP_OP_ONEDNN in
// amp/src/interception/policy_tables/cpu_table.cpp): float32 where oneDNN lacks `low`.
bool runs_fp32_here(const std::string& op, at::ScalarType low) {
  return op == "aten::mkldnn_rnn_layer" && !cpu_precision().onednn_supports(low);
}

TEST_P(PolicyTableCpuOp, AmpMatchesNativeAutocastAndControlBitForBit) {
  const at::ScalarType low = GetParam();
  std::map<std::string, CastPolicy> policies;
  for (const auto& row : policy_table(c10::kCPU)) policies[row.op] = row.policy;
  int compared = 0, grads_checked = 0;
  std::vector<std::string> without_kernel, fp32_fallbacks;
  DropWarnings quiet;
  c10::WarningUtils::WarningHandlerGuard drop_warnings(&quiet);
  for (const Sample& sample : cpu_samples()) {
    SCOPED_TRACE(sample.op + " in " + c10::toString(low));
    const CastPolicy policy = policies.at(sample.op);
    const Make make{policy == CastPolicy::kLowerPrecision ? at::kFloat : low};
    auto native_run = [&](const Args& args) {
      at::autocast::set_autocast_dtype(at::kCPU, low);
      at::autocast::set_autocast_enabled(at::kCPU, true);
      Outcome outcome = attempt([&] { return run_boxed(sample.op, args); });
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      at::autocast::clear_cache();
      return outcome;
    };
    // Inputs require grad where the op allows it (some losses refuse a
    // target that requires grad): then gradients are checked too.
    torch::manual_seed(0);
    Args args = with_grad(sample.args(make));
    Outcome native = native_run(args);
    if (!native.error.empty()) {
      torch::manual_seed(0);
      args = sample.args(make);
      native = native_run(args);
    }

    const Outcome control = attempt([&] { return run_boxed(sample.op, precast(args, policy, low)); });

    Options options = O1;
    options.verbosity = 0;
    options.cpu_dtype = low;
    Handle handle;
    handle.initialize(std::vector<ModulePtr>{}, {}, options);
    const Outcome ours = attempt([&] { return run_boxed(sample.op, args); });
    if (ours.error.empty() && backward_succeeds(ours.outputs)) {
      for (const at::Tensor& input : floating_inputs(args)) {
        if (input.grad().defined()) EXPECT_EQ(input.grad().scalar_type(), input.scalar_type());
      }
      ++grads_checked;
    }
    handle.deinitialize();

    if (!native.error.empty() && runs_fp32_here(sample.op, low)) {
      // Native autocast fails (oneDNN has no kernel for `low` on this CPU);
      // amp runs the op in float32 instead: exactly the plain fp32 call.
      ASSERT_TRUE(ours.error.empty()) << ours.error;
      const Outcome plain = attempt([&] { return run_boxed(sample.op, args); });
      ASSERT_TRUE(plain.error.empty()) << plain.error;
      for (size_t i = 0; i < ours.outputs.size(); ++i) {
        if (!is_scratch_output(sample.op, i)) EXPECT_TRUE(Same(sample.op, ours.outputs[i], plain.outputs[i]));
      }
      fp32_fallbacks.push_back(sample.op);
      continue;
    }
    if (!native.error.empty()) {  // no CPU kernel for this dtype: all three must agree
      EXPECT_FALSE(ours.error.empty()) << "native failed with: " << native.error;
      without_kernel.push_back(sample.op);
      continue;
    }
    ASSERT_TRUE(ours.error.empty()) << ours.error;
    ASSERT_TRUE(control.error.empty()) << control.error;
    ASSERT_EQ(ours.outputs.size(), native.outputs.size());
    ASSERT_EQ(ours.outputs.size(), control.outputs.size());
    for (size_t i = 0; i < ours.outputs.size(); ++i) {
      if (is_scratch_output(sample.op, i)) continue;
      EXPECT_TRUE(Same(sample.op, ours.outputs[i], native.outputs[i])) << "output " << i << " vs native";
      EXPECT_TRUE(Same(sample.op, ours.outputs[i], control.outputs[i])) << "output " << i << " vs control";
    }
    ++compared;
  }
  std::cout << "[ compared ] " << compared << " CPU ops in " << low << "; no " << low
            << " CPU kernel (native raises too): " << without_kernel.size();
  for (const auto& op : without_kernel) std::cout << " " << op;
  std::cout << "; run in fp32 by amp where native fails on this CPU: " << fp32_fallbacks.size();
  for (const auto& op : fp32_fallbacks) std::cout << " " << op;
  std::cout << "\n";
  std::cout << "[ grads    ] gradient dtypes checked for " << grads_checked
            << " ops (the others have no derivative for these inputs)\n";
  EXPECT_GE(compared, 100);
  EXPECT_GE(grads_checked, 80);
}

INSTANTIATE_TEST_SUITE_P(LowDtypes, PolicyTableCpuOp, ::testing::Values(at::kBFloat16, at::kHalf),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

}  // namespace
}  // namespace amp::testing
