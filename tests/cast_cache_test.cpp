// SPDX-License-Identifier: BSD-3-Clause
// The per-iteration cast cache: one cast per weight per iteration, never
// stale, never across grad modes, cleared by scale_loss.
#include "test_util.h"
#include <amp/internal/level_rules.h>

#include <ATen/autocast_mode.h>

namespace amp::testing {
namespace {

class CastCacheTest : public AmpTest {
 protected:
  void SetUp() override {
    weight = torch::randn({6, 4}, torch::requires_grad());
    bias = torch::randn({6}, torch::requires_grad());
    options = quiet(O1);
    handle.initialize(std::vector<ModulePtr>{}, {}, options);
  }
  void TearDown() override {
    handle.deinitialize();
    AmpTest::TearDown();
  }
  CastCounts delta(const CastCounts& before) const {
    const CastCounts now = cast_counts();
    return {now.casts - before.casts, now.cache_hits - before.cache_hits};
  }
  at::Tensor weight, bias;
  Options options;
  Handle handle;
};
// Tests that run amp on several threads (ThreadSanitizer runs every *ThreadsTest).
class CastCacheThreadsTest : public CastCacheTest {};

TEST_F(CastCacheTest, SharedWeightIsCastOncePerIteration) {
  const auto x = torch::randn({3, 4});
  const CastCounts before = cast_counts();
  const auto h1 = torch::linear(x, weight, bias);    // casts x, weight, bias
  const auto h2 = torch::linear(x, weight, bias);    // casts x again; weight, bias hit
  const CastCounts d = delta(before);
  EXPECT_EQ(d.casts, 4);
  EXPECT_EQ(d.cache_hits, 2);
  EXPECT_EQ(cast_cache_size(), 2u);
  EXPECT_TRUE(BitEqual(h1, h2));
}

TEST_F(CastCacheTest, TwoLayersSharingAWeightCastItOnce) {
  // Weight tying: two Linear modules holding the same parameter.
  torch::nn::Linear first(4, 4), second(4, 4);
  second->weight = first->weight;
  const auto x = torch::randn({2, 4});
  const CastCounts before = cast_counts();
  second(first(x));
  const CastCounts d = delta(before);
  // nn::Linear runs addmm(bias, x, weight.t()): x, the shared weight, both
  // biases are cast; the second layer's weight.t() hits; its bf16 input needs
  // no cast.
  EXPECT_EQ(d.casts, 4);
  EXPECT_EQ(d.cache_hits, 1);
}

TEST_F(CastCacheTest, ActivationsAreNeverCached) {
  const auto activation = torch::randn({3, 4}, torch::requires_grad()) * 2;  // not a leaf
  const CastCounts before = cast_counts();
  torch::mm(activation, weight.t());
  torch::mm(activation, weight.t());
  const CastCounts d = delta(before);
  EXPECT_EQ(d.casts, 3);       // the activation twice, the weight once
  EXPECT_EQ(d.cache_hits, 1);  // weight.t() the second time: a view of the cached copy
  EXPECT_EQ(cast_cache_size(), 1u);
}

TEST_F(CastCacheTest, InPlaceUpdateOfTheWeightInvalidatesItsEntry) {
  const auto x = torch::randn({3, 4});
  torch::linear(x, weight);
  {
    torch::NoGradGuard no_grad;
    weight.add_(1.0);  // what an optimizer step does
  }
  const CastCounts before = cast_counts();
  const auto y = torch::linear(x, weight);
  EXPECT_EQ(delta(before).casts, 2);  // x and the edited weight: no stale hit
  EXPECT_EQ(delta(before).cache_hits, 0);
  disable_casts exact;
  EXPECT_TRUE(BitEqual(y, torch::linear(x.to(at::kBFloat16), weight.to(at::kBFloat16))));
}

// cast_cache.h: writes through .data() keep the weight's version counter, so
// the cache serves the old copy until it is cleared.
TEST_F(CastCacheTest, WritesThroughDataAreSeenOnlyAfterTheCacheIsCleared) {
  const auto x = torch::randn({3, 4});
  const auto before_edit = torch::linear(x, weight);
  weight.data().mul_(2);
  EXPECT_TRUE(BitEqual(torch::linear(x, weight), before_edit)) << "the documented stale window";
  clear_cast_cache();
  const auto after_clear = torch::linear(x, weight);
  disable_casts exact;
  EXPECT_TRUE(BitEqual(after_clear, torch::linear(x.to(at::kBFloat16), weight.to(at::kBFloat16))));
  EXPECT_FALSE(BitEqual(after_clear, before_edit));
}

TEST_F(CastCacheTest, CopyMadeUnderNoGradIsNotReusedWithGradOn) {
  const auto x = torch::randn({3, 4});
  {
    torch::NoGradGuard eval;
    torch::linear(x, weight);  // caches a copy without autograd history
  }
  const CastCounts before = cast_counts();
  const auto y = torch::linear(x, weight);
  EXPECT_EQ(delta(before).cache_hits, 0);
  ASSERT_TRUE(y.requires_grad());
  y.to(at::kFloat).sum().backward();
  ASSERT_TRUE(weight.grad().defined());  // the weight is in the graph
  EXPECT_EQ(weight.grad().scalar_type(), at::kFloat);
  // The other direction is safe and reuses the copy.
  const CastCounts after_grad = cast_counts();
  {
    torch::NoGradGuard eval;
    torch::linear(x, weight);
  }
  EXPECT_EQ(delta(after_grad).cache_hits, 1);
}

TEST_F(CastCacheTest, ViewOfACachedWeightGivesTheSameValuesAndGradients) {
  const auto x = torch::randn({3, 4}, torch::requires_grad());
  const auto y = torch::addmm(bias, x, weight.t());  // the weight is cast via its view
  y.to(at::kFloat).sum().backward();
  const at::Tensor weight_grad = weight.grad().clone(), x_grad = x.grad().clone();
  weight.mutable_grad() = at::Tensor();
  x.mutable_grad() = at::Tensor();
  // Reference: the plain cast of the view, without amp.
  disable_casts exact;
  const auto reference = torch::addmm(bias.to(at::kBFloat16), x.to(at::kBFloat16),
                                      weight.t().to(at::kBFloat16));
  reference.to(at::kFloat).sum().backward();
  EXPECT_TRUE(BitEqual(y, reference));
  EXPECT_TRUE(BitEqual(weight_grad, weight.grad()));
  EXPECT_TRUE(BitEqual(x_grad, x.grad()));
}

// weight.t() (nn::Linear's addmm operand) met first is cast as it is - one
// op, as native autocast casts it, no transpose or as_strided of a copy -
// and the weight met after it in the iteration is served that copy's
// transpose, whose backward transposes the gradient back: one cast in all.
// Met after the weight, weight.t() is the weight's copy's transpose. Never
// an as_strided view, whose backward zero-fills and scatters a weight-sized
// tensor. Another view of the weight is still served with its geometry,
// with its values and gradient.
TEST_F(CastCacheTest, ATransposedWeightIsServedAsATransposeOtherViewsAsStrided) {
  auto operand_nodes = [](const at::Tensor& out) {
    std::vector<std::string> names;
    for (const auto& edge : out.grad_fn()->next_edges()) {
      if (edge.function) names.push_back(edge.function->name());
    }
    return names;
  };
  const auto x = torch::randn({3, 4}, torch::requires_grad()), a = torch::randn({2, 6});
  const CastCounts before = cast_counts();
  const auto y = torch::addmm(bias, x, weight.t());
  EXPECT_THAT(operand_nodes(y), ::testing::Each(::testing::Eq("ToCopyBackward0")));
  const auto plain = torch::mm(a, weight);
  EXPECT_EQ(delta(before).cache_hits, 1);
  EXPECT_THAT(operand_nodes(plain), ::testing::Contains("TBackward0"));
  (y.to(at::kFloat).sum() + plain.to(at::kFloat).sum()).backward();
  const at::Tensor grad = weight.grad().clone();
  weight.mutable_grad() = at::Tensor();
  {
    disable_casts exact;  // one copy, the transpose's, both gradients summed in it
    const at::Tensor w_t = weight.t().to(at::kBFloat16);
    EXPECT_TRUE(BitEqual(plain, torch::mm(a.to(at::kBFloat16), w_t.t())));
    (torch::addmm(bias.to(at::kBFloat16), x.to(at::kBFloat16), w_t).to(at::kFloat).sum() +
     torch::mm(a.to(at::kBFloat16), w_t.t()).to(at::kFloat).sum())
        .backward();
  }
  EXPECT_TRUE(BitEqual(grad, weight.grad()));
  weight.mutable_grad() = at::Tensor();

  clear_cast_cache();  // the other order
  torch::mm(a, weight);
  const auto z = torch::addmm(bias, x, weight.t());
  EXPECT_THAT(operand_nodes(z), ::testing::Contains("TBackward0"));
  EXPECT_THAT(operand_nodes(z), ::testing::Not(::testing::Contains("AsStridedBackward0")));
  EXPECT_TRUE(BitEqual(z, y));

  weight.mutable_grad() = at::Tensor();
  const auto columns = weight.slice(/*dim=*/1, 1, 3);  // [6, 2], strides (4, 1), offset 1
  const auto b = torch::randn({5, 6});
  const auto c = torch::mm(b, columns);
  EXPECT_EQ(c.scalar_type(), at::kBFloat16);
  c.to(at::kFloat).sum().backward();
  const at::Tensor columns_grad = weight.grad().clone();
  weight.mutable_grad() = at::Tensor();
  {
    disable_casts exact;
    torch::mm(b.to(at::kBFloat16), weight.slice(1, 1, 3).to(at::kBFloat16)).to(at::kFloat).sum().backward();
  }
  EXPECT_TRUE(BitEqual(columns_grad.slice(1, 1, 3), weight.grad().slice(1, 1, 3)));
  EXPECT_TRUE(columns_grad.slice(1, 0, 1).eq(0).all().item<bool>() &&
              columns_grad.slice(1, 3, 4).eq(0).all().item<bool>());
}

TEST_F(CastCacheTest, InferenceModeCastsAreNotCached) {
  {
    c10::InferenceMode inference;
    const auto y = torch::linear(torch::randn({3, 4}), weight);
    EXPECT_TRUE(internal::is_low_precision(y.scalar_type())) << "the weight was cast";
    EXPECT_EQ(cast_cache_size(), 0u);
  }
  torch::linear(torch::randn({3, 4}), weight);  // the same cast outside inference mode
  EXPECT_EQ(cast_cache_size(), 1u);
}

TEST_F(CastCacheTest, ClearedWhenScaleLossExitsAndOnDeinitialize) {
  handle.deinitialize();
  auto model = TinyNet();
  std::shared_ptr<torch::optim::Optimizer> optimizer =
      std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
  auto loss = model->forward(torch::randn({2, 8})).to(at::kFloat).sum();
  EXPECT_EQ(cast_cache_size(), 4u);  // two weights, two biases
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();
    EXPECT_EQ(cast_cache_size(), 4u);
  }
  EXPECT_EQ(cast_cache_size(), 0u);
  model->forward(torch::randn({2, 8}));
  EXPECT_EQ(cast_cache_size(), 4u);
  handle.deinitialize();
  EXPECT_EQ(cast_cache_size(), 0u);
}

TEST_F(CastCacheThreadsTest, ConcurrentForwardsShareTheCacheSafely) {
  torch::nn::Linear layer(4, 6);
  const auto x = torch::randn({3, 4});
  at::Tensor reference;
  {
    disable_casts exact;
    reference = torch::linear(x.to(at::kBFloat16), layer->weight.to(at::kBFloat16),
                              layer->bias.to(at::kBFloat16));
  }
  const CastCounts before = cast_counts();
  std::atomic<int> mismatches{0};
  // Two rounds: the second round's threads reuse the counters of the first's.
  for (int round = 0; round < 2; ++round) {
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        enable_casts casts;
        for (int i = 0; i < 50; ++i) {
          if (!torch::equal(layer(x), reference)) mismatches.fetch_add(1);
        }
      });
    }
    for (auto& thread : threads) thread.join();
  }
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(cast_cache_size(), 2u);
  // Counts of threads that have ended stay counted: per call, x is cast and
  // the weight and bias are each cast or served from the cache.
  const CastCounts after = cast_counts();
  EXPECT_EQ((after.casts - before.casts) + (after.cache_hits - before.cache_hits), 2 * 4 * 50 * 3);
  EXPECT_GE(after.cache_hits - before.cache_hits, 2 * 4 * 50 * 2 - 8);  // a weight cast at most once per thread
}

// --- One iteration ends: LibTorch's autocast cache too (other libraries' ------
// autocast kernels, such as torchvision's, cast through it) ---------------------

TEST_F(AmpTest, GuardEndClearsLibTorchsNativeAutocastCache) {
  auto model = TinyNet();
  OptimizerPtr optimizer = std::make_shared<torch::optim::SGD>(model->parameters(), 0.1);
  Handle handle;
  std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(O4));
  EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), at::kBFloat16);  // native kernels follow amp
  const auto& w = model->fc1->weight;
  const auto first = at::autocast::cached_cast(at::kBFloat16, w, c10::kCPU);
  EXPECT_TRUE(at::autocast::cached_cast(at::kBFloat16, w, c10::kCPU).is_same(first)) << "native cache in use";
  {
    scale_loss scaled(model->forward(torch::randn({2, 8})).to(at::kFloat).sum(), optimizer);
    scaled.backward();
  }
  EXPECT_FALSE(at::autocast::cached_cast(at::kBFloat16, w, c10::kCPU).is_same(first));
}

}  // namespace
}  // namespace amp::testing
