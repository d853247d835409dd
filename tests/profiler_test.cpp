// SPDX-License-Identifier: BSD-3-Clause
// amp in LibTorch's profiler: a traced step shows amp's own work under its
// names (amp/src/trace_range.h), nested in the ops it serves, with shapes.
#include "test_util.h"

#include "profiled.h"

#include <amp/recompute.h>

namespace amp::testing {
namespace {

using torch::autograd::profiler::KinetoEvent;

const KinetoEvent* find(const std::vector<KinetoEvent>& events, const std::string& name) {
  for (const auto& e : events) {
    if (e.name() == name) return &e;
  }
  return nullptr;
}

// `inner` lies within `outer` on the same thread.
bool nested(const KinetoEvent& inner, const KinetoEvent& outer) {
  return inner.startThreadId() == outer.startThreadId() && outer.startNs() <= inner.startNs() &&
         inner.endNs() <= outer.endNs();
}

// One O1 step with a dynamic scale and amp's fused AdamW: the activation's
// and the weight's casts (inside the op they serve, with the input's shape),
// the unscale and inf/NaN check, the scale update and the fused step.
TEST_F(AmpTest, ATracedStepShowsAmpsWorkByName) {
  torch::manual_seed(0);
  torch::nn::Linear model(8, 4);
  amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
  Options options = quiet(O1);
  options.loss_scale = LossScale::Dynamic();
  Handle handle;
  handle.initialize(model, optimizer, options);
  const at::Tensor x = torch::randn({16, 8});
  const auto events = profiled([&] {
    optimizer.zero_grad();
    {
      scale_loss scaled(model->forward(x).to(at::kFloat).pow(2).mean(), optimizer);
      scaled.backward();
    }
    optimizer.step();
  });
  const std::multiset<std::string> ranges = amp_ranges(events);
  EXPECT_EQ(ranges.count("amp::cast"), 1u) << "the activation";
  EXPECT_EQ(ranges.count("amp::cast (cached weight)"), 2u) << "the weight and the bias, once each";
  EXPECT_EQ(ranges.count("amp::unscale and inf/NaN check"), 1u);
  EXPECT_EQ(ranges.count("amp::scale update"), 1u);
  EXPECT_EQ(ranges.count("amp::fused step"), 1u);

  const KinetoEvent* cast = find(events, "amp::cast");
  const KinetoEvent* addmm = find(events, "aten::addmm");  // what torch::nn::Linear calls
  ASSERT_TRUE(cast != nullptr && addmm != nullptr);
  EXPECT_TRUE(nested(*cast, *addmm)) << "a cast appears inside the op it serves";

  ASSERT_FALSE(cast->shapes().empty());
  EXPECT_EQ(cast->shapes()[0], std::vector<int64_t>({16, 8}));

  // Within an iteration the weights' copies are cache hits: a second
  // forward adds activation casts only.
  const auto twice = amp_ranges(profiled([&] {
    optimizer.zero_grad();
    const at::Tensor y = model->forward(x) + model->forward(x);
    scale_loss scaled(y.to(at::kFloat).pow(2).mean(), optimizer);
    scaled.backward();
  }));
  EXPECT_EQ(twice.count("amp::cast (cached weight)"), 2u);
  EXPECT_EQ(twice.count("amp::cast"), 2u);
}

// O2's weights moving between their float32 masters and the low dtype, and a
// recomputed block's rerun.
TEST_F(AmpTest, MastersAndRecomputationShowInTheTrace) {
  torch::manual_seed(0);
  torch::nn::Linear model(8, 8);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  Handle handle;
  handle.initialize(model, optimizer, quiet(O2));
  const at::Tensor x = torch::randn({4, 8});
  const auto ranges = amp_ranges(profiled([&] {
    optimizer.zero_grad();
    const at::Tensor y = amp::recompute([&](const at::Tensor& in) { return model->forward(in); }, x);
    {
      scale_loss scaled(y.to(at::kFloat).pow(2).mean(), optimizer);
      scaled.backward();
    }
    optimizer.step();
  }));
  EXPECT_GE(ranges.count("amp::weights to the low dtype"), 1u);
  EXPECT_EQ(ranges.count("amp::weights to float32 masters"), 1u);
  EXPECT_EQ(ranges.count("amp::recompute (forward rerun and backward)"), 1u);
}

}  // namespace
}  // namespace amp::testing
