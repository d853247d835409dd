// SPDX-License-Identifier: BSD-3-Clause
// Exceptions inside scale_loss guards, errors a guard ends with, and what
// an overflow verdict applies to.
#include "test_util.h"
#include <amp/internal/level_rules.h>

#include <limits>

namespace amp::testing {
namespace {


// --- Exceptions inside guards; when a queued skip applies --------------------

class GuardUnwindTest : public AmpTest, public ::testing::WithParamInterface<OptLevel> {};

// A model and a reference from the same weights, each with its own SGD and
// loss scaler (loss ids 0 and 1), initialized together.
struct Twins {
  TinyNet model, reference;
  OptimizerPtr optimizer, ref_optimizer;
};
Twins twins(Handle& handle, Options options) {
  torch::manual_seed(0);
  Twins t{TinyNet(), TinyNet(), nullptr, nullptr};
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < t.model->parameters().size(); ++i) t.reference->parameters()[i].copy_(t.model->parameters()[i]);
  }
  t.optimizer = std::make_shared<torch::optim::SGD>(t.model->parameters(), 0.1);
  t.ref_optimizer = std::make_shared<torch::optim::SGD>(t.reference->parameters(), 0.1);
  options.num_losses = 2;
  handle.initialize({t.model, t.reference}, {t.optimizer, t.ref_optimizer}, options);
  return t;
}

TEST_P(GuardUnwindTest, ExceptionAfterUnscaleRestoresGradientsAndScaler) {
  Options options = quiet(GetParam());
  options.dynamic_scaling.growth_interval = 1;  // a clean guard would grow the scale
  Handle handle;
  auto [model, reference, optimizer, ref_optimizer] = twins(handle, options);
  const auto x = torch::randn({3, 8});
  for (int id : {0, 1}) {
    auto [m, o] = id == 0 ? std::pair{model, optimizer} : std::pair{reference, ref_optimizer};
    o->zero_grad();
    scale_loss scaled(m->forward(x).to(at::kFloat).sum(), o, {id});
    scaled.backward();
  }
  std::vector<at::Tensor> before;
  for (const auto& p : master_params(*optimizer)) before.push_back(p.grad().clone());
  const internal::LossScaling::State scaler_before = internal::live_scaling().state();
  try {
    scale_loss scaled(model->forward(x * 2).to(at::kFloat).sum(), optimizer);
    scaled.backward();
    scaled.unscale();
    throw std::runtime_error("clipping rejected the gradients");
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "clipping rejected the gradients");
  }
  const auto params = master_params(*optimizer);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(BitEqual(params[i].grad(), before[i])) << "param " << i;
  EXPECT_TRUE(BitEqual(internal::live_scaling().state().scale, scaler_before.scale));
  EXPECT_TRUE(BitEqual(internal::live_scaling().state().growth_tracker, scaler_before.growth_tracker));
  optimizer->step();
  ref_optimizer->step();
  EXPECT_FALSE(last_step_skipped(*optimizer));
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(BitEqual(model->parameters()[i], reference->parameters()[i])) << "param " << i;
  }
}

// A micro-batch's guard that throws takes only its own backward with it:
// the sum of the micro-batches before it is held off the parameters again
// (a step() then changes nothing), and the accumulation ends bit for bit
// as one that never ran the failed micro-batch.
TEST_P(GuardUnwindTest, AnExceptionInALaterMicroBatchKeepsTheSumBeforeIt) {
  Handle handle;
  auto [model, reference, optimizer, ref_optimizer] = twins(handle, quiet(GetParam()));
  const std::vector<at::Tensor> micro = {torch::randn({3, 8}), torch::randn({3, 8}), torch::randn({3, 8})};
  auto accumulate = [&](TinyNet& m, OptimizerPtr& o, int id, const at::Tensor& x, bool last) {
    scale_loss scaled(m->forward(x).to(at::kFloat).sum(), o, {id, /*delay_unscale=*/!last});
    scaled.backward();
  };
  optimizer->zero_grad();
  ref_optimizer->zero_grad();
  accumulate(model, optimizer, 0, micro[0], false);
  accumulate(reference, ref_optimizer, 1, micro[0], false);
  try {
    scale_loss scaled(model->forward(micro[1]).to(at::kFloat).sum(), optimizer, {0, /*delay_unscale=*/true});
    scaled.backward();
    throw std::runtime_error("the data loader failed");
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "the data loader failed");
  }
  std::vector<at::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
  optimizer->step();  // still accumulating: sees no gradients
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(BitEqual(model->parameters()[i], before[i])) << "param " << i;
  accumulate(model, optimizer, 0, micro[2], true);
  accumulate(reference, ref_optimizer, 1, micro[2], true);
  optimizer->step();
  ref_optimizer->step();
  EXPECT_FALSE(last_step_skipped(*optimizer));
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_FALSE(BitEqual(model->parameters()[i], before[i])) << "param " << i << " must have stepped";
    EXPECT_TRUE(BitEqual(model->parameters()[i], reference->parameters()[i])) << "param " << i;
  }
}

TEST_P(GuardUnwindTest, QueuedSkipDoesNotOutliveTheGradientsItJudged) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(GetParam()));
  const auto x = torch::randn({3, 8});
  {
    scale_loss scaled(model->forward(x).to(at::kFloat).sum(), optimizer);
    scaled.backward();
    model->fc1->weight.grad()[0][0].fill_(kInf);
  }
  // The user's code fails between the guard and step(); the loop catches it,
  // zeroes and goes on: the overflowed gradients are gone, so is their skip.
  for (bool through_model : {false, true}) {
    if (through_model) model->zero_grad(); else optimizer->zero_grad();
    const auto before = model->fc2->weight.detach().clone();
    {
      scale_loss scaled(model->forward(x).to(at::kFloat).sum(), optimizer);
      scaled.backward();
    }
    optimizer->step();
    EXPECT_FALSE(last_step_skipped(*optimizer));
    EXPECT_FALSE(BitEqual(model->fc2->weight, before)) << "the clean step must be taken";
  }
  // The overflow cost one step: its guard discarded the gradients it judged.
  EXPECT_EQ(skipped_steps(*optimizer), internal::resolve_properties(GetParam(), {}).loss_scale.dynamic ? 1 : 0);
}

INSTANTIATE_TEST_SUITE_P(Levels, GuardUnwindTest, ::testing::Values(O1, O2, O5),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST_F(GuardUnwindTest, FinishEndsTheGuardWhereErrorsAreExpected) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O2));
  scale_loss scaled(model->forward(torch::randn({3, 8})).to(at::kFloat).sum(), optimizer);
  scaled.backward();
  scaled.finish();
  EXPECT_EQ(model->fc1->weight.scalar_type(), at::kFloat) << "the masters rest";
  EXPECT_EQ(model->fc1->weight.grad().scalar_type(), at::kFloat) << "with their float32 gradients";
  EXPECT_AMP_ERROR(scaled.finish(), "already called");
  EXPECT_AMP_ERROR(scaled.unscale(), "has finished");
  optimizer->step();  // the guard is over even though its scope is not
}

TEST_F(GuardUnwindTest, BackwardOutsideTheGuardAtO2IsAClearErrorAtTheNextGuard) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O2));
  model->forward(torch::randn({3, 8})).to(at::kFloat).sum().backward();
  const auto loss = model->forward(torch::randn({3, 8})).to(at::kFloat).sum();
  EXPECT_AMP_ERROR(scale_loss(loss, optimizer), "backward ran outside amp::scale_loss");
}

}  // namespace
}  // namespace amp::testing
