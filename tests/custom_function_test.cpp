// SPDX-License-Identifier: BSD-3-Clause
// custom_fwd / custom_bwd: a user's autograd function declares the precision
// of its forward, and its backward runs with the casting state of forward.
#include "test_util.h"

#include <torch/cuda.h>

#include <thread>

namespace amp::testing {
namespace {

// Dtypes seen inside the last forward and backward.
struct Seen {
  at::ScalarType forward_inputs = at::kDouble, forward_output = at::kDouble, backward_mm = at::kDouble;
  std::thread::id backward_thread;
};
Seen g_seen;

// mm(a, b), saving a and b; the dtypes are recorded in g_seen.
at::Tensor matmul_forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
  ctx->save_for_backward({a, b});
  const at::Tensor out = torch::mm(a, b);
  g_seen.forward_inputs = a.scalar_type();
  g_seen.forward_output = out.scalar_type();
  return out;
}

// The gradients of mm(a, b) from the saved a and b, under custom_bwd.
torch::autograd::variable_list matmul_backward(torch::autograd::AutogradContext* ctx,
                                               const torch::autograd::variable_list& grads) {
  custom_bwd bwd(ctx);
  const auto saved = ctx->get_saved_variables();
  const at::Tensor grad_a = grads[0].mm(saved[1].t());
  g_seen.backward_mm = grad_a.scalar_type();
  g_seen.backward_thread = std::this_thread::get_id();
  return {grad_a, saved[0].t().mm(grads[0])};
}

// forward: mm in float32 whatever amp does (cast_inputs = float32).
struct Fp32Matmul : torch::autograd::Function<Fp32Matmul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    custom_fwd fwd(ctx, at::kFloat);
    return matmul_forward(ctx, fwd.cast(a), fwd.cast(b));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return matmul_backward(ctx, grads);
  }
};

// forward: mm under amp's casts (no cast_inputs); backward computes with the
// fp32 tensors it saved, so it needs forward's casts to meet the bf16 grad.
struct CastingMatmul : torch::autograd::Function<CastingMatmul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    custom_fwd fwd(ctx);
    return matmul_forward(ctx, a, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return matmul_backward(ctx, grads);
  }
};

struct NoState : torch::autograd::Function<NoState> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& a) { return a * 2; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    custom_bwd bwd(ctx);
    return {grads[0] * 2};
  }
};

class CustomFunctionTest : public AmpTest {
 protected:
  void TearDown() override {
    handle.deinitialize();
    AmpTest::TearDown();
  }
  Handle handle;
  at::Tensor a = torch::randn({3, 4}).requires_grad_(), b = torch::randn({4, 5}).requires_grad_();
  at::Tensor weights = torch::randn({3, 5});  // d(sum(out * weights)) / d out
};

TEST_F(CustomFunctionTest, CastInputsRunsForwardAndBackwardInFloat32UnderO1) {
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  const at::Tensor low_a = a.to(at::kBFloat16);  // a bf16 activation meets an fp32 weight
  const at::Tensor out = Fp32Matmul::apply(low_a, b);
  EXPECT_EQ(g_seen.forward_inputs, at::kFloat);
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  (out * weights).sum().backward();
  EXPECT_EQ(g_seen.backward_mm, at::kFloat);
  // Reference: the same math in float32 without amp.
  disable_casts exact;
  const at::Tensor ra = low_a.detach().to(at::kFloat).requires_grad_(), rb = b.detach().clone().requires_grad_();
  const at::Tensor reference = torch::mm(ra, rb);
  (reference * weights).sum().backward();
  EXPECT_TRUE(BitEqual(out, reference));
  EXPECT_TRUE(BitEqual(a.grad(), ra.grad().to(at::kBFloat16).to(at::kFloat)));
  EXPECT_TRUE(BitEqual(b.grad(), rb.grad()));
}

TEST_F(CustomFunctionTest, BackwardCastsAsForwardDid) {
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  const at::Tensor out = CastingMatmul::apply(a, b);
  EXPECT_EQ(g_seen.forward_output, at::kBFloat16);
  (out.to(at::kFloat) * weights).sum().backward();
  EXPECT_EQ(g_seen.backward_mm, at::kBFloat16);  // the bf16 grad met fp32 saved tensors: cast
  // Reference: the bf16 math written out, no amp.
  disable_casts exact;
  const at::Tensor g = weights.to(at::kBFloat16);
  EXPECT_TRUE(BitEqual(a.grad(), g.mm(b.detach().to(at::kBFloat16).t()).to(at::kFloat)));
  EXPECT_TRUE(BitEqual(b.grad(), a.detach().to(at::kBFloat16).t().mm(g).to(at::kFloat)));
}

// On CUDA, backward runs on autograd's device thread, not the one that
// called backward(): custom_bwd carries forward's casting state there.
TEST_F(CustomFunctionTest, BackwardOnAutogradsCudaThreadCastsAsForwardDid) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  const at::Tensor ca = a.detach().cuda().requires_grad_(), cb = b.detach().cuda().requires_grad_();
  const at::Tensor out = CastingMatmul::apply(ca, cb);
  EXPECT_EQ(g_seen.forward_output, at::kHalf);
  (out.to(at::kFloat) * weights.cuda()).sum().backward();
  EXPECT_NE(g_seen.backward_thread, std::this_thread::get_id()) << "autograd's CUDA thread ran backward";
  EXPECT_EQ(g_seen.backward_mm, at::kHalf);
  disable_casts exact;
  const at::Tensor g = weights.cuda().to(at::kHalf);
  EXPECT_TRUE(BitEqual(ca.grad(), g.mm(cb.detach().to(at::kHalf).t()).to(at::kFloat)));
}

TEST_F(CustomFunctionTest, WithoutCastsNothingIsCastInsideEither) {
  handle.initialize(std::vector<ModulePtr>{}, {}, quiet(O1));
  const at::Tensor low_a = a.to(at::kBFloat16).detach().requires_grad_();
  const at::Tensor low_b = b.to(at::kBFloat16).detach().requires_grad_();
  {
    disable_casts off;  // cast_inputs does nothing where amp does not cast
    const at::Tensor out = Fp32Matmul::apply(low_a, low_b);
    EXPECT_EQ(g_seen.forward_inputs, at::kBFloat16);
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    out.sum().backward();
  }
  EXPECT_EQ(g_seen.backward_mm, at::kBFloat16);
  handle.deinitialize();
  const at::Tensor out = CastingMatmul::apply(a, b);  // amp not initialized: plain LibTorch
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  out.sum().backward();
  EXPECT_EQ(g_seen.backward_mm, at::kFloat);
}

TEST_F(CustomFunctionTest, BackwardWithoutForwardStateIsAClearError) {
  const at::Tensor x = torch::ones({2}).requires_grad_();
  EXPECT_AMP_ERROR(NoState::apply(x).sum().backward(), "open an amp::custom_fwd");
  EXPECT_AMP_ERROR(custom_fwd(nullptr, at::kLong), "floating dtype");
}

}  // namespace
}  // namespace amp::testing
