// SPDX-License-Identifier: BSD-3-Clause
// Sparse gradients (nn::Embedding with sparse=true): unscaled and checked for
// overflow like dense ones at O0/O1; refused clearly at the levels that cast
// the model.
#include "test_util.h"

#include <limits>

namespace amp::testing {
namespace {

struct BagOfWordsImpl : torch::nn::Module {
  BagOfWordsImpl()
      : embed(register_module("embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(50, 8).sparse(true)))),
        head(register_module("head", torch::nn::Linear(8, 3))) {}
  at::Tensor forward(const at::Tensor& tokens) { return head(embed(tokens).mean(1)); }
  torch::nn::Embedding embed;
  torch::nn::Linear head;
};
TORCH_MODULE(BagOfWords);

class SparseGradientTest : public AmpTest {
 protected:
  void TearDown() override {
    handle.deinitialize();
    AmpTest::TearDown();
  }
  Handle handle;
};

// Two copies of one model: amp's scaled guard, and plain unscaled backward
// under the same casts. Scaling by a power of two is exact, so unscaled
// gradients, and so the parameters after each SGD step, are bit-identical;
// an inf in the sparse gradient skips amp's step.
TEST_F(SparseGradientTest, SparseGradientsAreUnscaledAndCheckedAtO1) {
  torch::manual_seed(0);
  BagOfWords model, reference;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < model->parameters().size(); ++i) {
      reference->parameters()[i].copy_(model->parameters()[i]);
    }
  }
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.5);
  torch::optim::SGD plain(reference->parameters(), 0.5);
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O1));
  for (int step = 0; step < 4; ++step) {
    const auto tokens = torch::randint(50, {6, 5}, at::kLong);
    const auto target = torch::randn({6, 3});
    const bool overflow = step == 2;
    optimizer->zero_grad();
    {
      scale_loss scaled(torch::mse_loss(model->forward(tokens), target), optimizer);
      scaled.backward();
      ASSERT_TRUE(model->embed->weight.grad().is_sparse());
      if (overflow) {
        model->embed->weight.grad()._values()[0][0] = std::numeric_limits<float>::infinity();
      }
    }
    optimizer->step();
    EXPECT_EQ(last_step_skipped(*optimizer), overflow) << "step " << step;
    if (!overflow) {
      plain.zero_grad();
      torch::mse_loss(reference->forward(tokens), target).backward();
      plain.step();
    }
    for (size_t i = 0; i < model->parameters().size(); ++i) {
      EXPECT_TRUE(BitEqual(model->parameters()[i], reference->parameters()[i]))
          << "step " << step << ", parameter " << i;
    }
  }
  EXPECT_EQ(loss_scale(), 32768.0);  // one back-off
}

TEST_F(SparseGradientTest, LevelsThatCastTheModelRefuseSparseGradients) {
  for (OptLevel level : {O2, O3, O5}) {
    BagOfWords model;
    OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.5);
    const auto before = model->embed->weight.clone();
    EXPECT_AMP_ERROR(handle.initialize(model, optimizer, quiet(level)), "sparse gradients");
    EXPECT_FALSE(is_initialized());
    EXPECT_EQ(model->embed->weight.scalar_type(), at::kFloat);  // nothing converted
    EXPECT_TRUE(BitEqual(model->embed->weight, before));
  }
}

// GradScaler's rule for float16 sparse gradients: duplicate indices are summed
// when the gradient is used, and two finite halves can sum past 65504. Such
// a gradient is an overflow; its values are unscaled once either way.
TEST_F(SparseGradientTest, Fp16DuplicateIndicesWhoseSumOverflowsAreAnOverflow) {
  const auto indices = torch::tensor({0, 0, 1}, at::kLong).unsqueeze(0);
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16, at::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto values = torch::tensor({40000.0, 40000.0, 2.0}).to(dtype);
    auto grad = torch::sparse_coo_tensor(indices, values.clone(), {4});
    ASSERT_FALSE(grad.is_coalesced());
    internal::LossScaling scaler(LossScale::Dynamic(), DynamicScaling{});
    at::Tensor found_inf = torch::zeros({1});
    scaler.unscale({grad}, found_inf);
    EXPECT_EQ(found_inf.item<float>() > 0, dtype == at::kHalf) << "only float16 sums overflow";
    EXPECT_TRUE(BitEqual(grad._values(), (values.to(at::kDouble) / 65536.0).to(dtype)));
  }
}

}  // namespace
}  // namespace amp::testing
