// SPDX-License-Identifier: BSD-3-Clause
// The boxed kernel (any schema: users' own ops) applies every policy exactly
// as the typed kernel of a built-in op does. Each test runs an ATen op and
// its twin - a user op with the same schema, implemented by the ATen op -
// under the same policy, and expects bit-identical outputs and gradients and
// the same recorded call: policy, input and output dtypes, casts.
#include "test_util.h"

#include <torch/library.h>

namespace {

TORCH_LIBRARY(amp_twin, m) {
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("softmax(Tensor self, int dim, ScalarType? dtype=None) -> Tensor");
  m.def("cat(Tensor[] tensors, int dim=0) -> Tensor");
  m.def("layer_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05, bool cudnn_enable=True) -> Tensor");
}

// CompositeImplicitAutograd: the twin differentiates through the ATen op,
// which runs below amp (the kernel excludes its key while it calls the op).
TORCH_LIBRARY_IMPL(amp_twin, CompositeImplicitAutograd, m) {
  m.impl("linear", [](const at::Tensor& input, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) { return at::linear(input, weight, bias); });
  m.impl("softmax", [](const at::Tensor& self, int64_t dim, std::optional<at::ScalarType> dtype) {
    return at::softmax(self, dim, dtype);
  });
  m.impl("cat", [](at::TensorList tensors, int64_t dim) { return at::cat(tensors, dim); });
  m.impl("layer_norm", [](const at::Tensor& input, at::IntArrayRef shape,
                          const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                          double eps, bool cudnn_enable) {
    return at::layer_norm(input, shape, weight, bias, eps, cudnn_enable);
  });
}

template <class Signature>
c10::TypedOperatorHandle<Signature> twin(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor twin_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  static auto op = twin<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>(
      "amp_twin::linear");
  return op.call(x, w, b);
}
at::Tensor twin_softmax(const at::Tensor& x, int64_t dim, std::optional<at::ScalarType> dtype) {
  static auto op = twin<at::Tensor(const at::Tensor&, int64_t, std::optional<at::ScalarType>)>("amp_twin::softmax");
  return op.call(x, dim, dtype);
}
at::Tensor twin_cat(at::TensorList tensors) {
  static auto op = twin<at::Tensor(at::TensorList, int64_t)>("amp_twin::cat");
  return op.call(tensors, 0);
}
at::Tensor twin_layer_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  static auto op = twin<at::Tensor(const at::Tensor&, at::IntArrayRef, const std::optional<at::Tensor>&,
                                   const std::optional<at::Tensor>&, double, bool)>("amp_twin::layer_norm");
  return op.call(x, {x.size(-1)}, w, b, 1e-5, true);
}

}  // namespace

namespace amp::testing {
namespace {

// One call's output, the gradients of `leaves`, and amp's record of it.
struct Observed {
  at::Tensor output;
  std::vector<at::Tensor> grads;
  OpStats row;
};

template <class Fn>
Observed observe(Fn&& call, std::vector<at::Tensor> leaves) {
  for (auto& leaf : leaves) leaf.mutable_grad().reset();
  clear_cast_cache();
  Observed seen;
  {
    OpStatsRecorder recorder;
    seen.output = call();
    const std::vector<OpStats> rows = recorder.stats();
    EXPECT_EQ(rows.size(), 1u) << format_op_stats(rows);
    if (!rows.empty()) seen.row = rows.front();
  }
  if (seen.output.requires_grad()) {
    disable_casts exact;
    (seen.output.to(at::kDouble) * torch::arange(seen.output.numel(), at::kDouble).view_as(seen.output))
        .sum()
        .backward();
  }
  for (const auto& leaf : leaves) seen.grads.push_back(leaf.grad());
  return seen;
}

void expect_same(const Observed& twin, const Observed& aten) {
  EXPECT_TRUE(BitEqual(twin.output, aten.output));
  ASSERT_EQ(twin.grads.size(), aten.grads.size());
  for (size_t i = 0; i < twin.grads.size(); ++i) {
    ASSERT_EQ(twin.grads[i].defined(), aten.grads[i].defined()) << "gradient " << i;
    if (twin.grads[i].defined()) EXPECT_TRUE(BitEqual(twin.grads[i], aten.grads[i])) << "gradient " << i;
  }
  EXPECT_EQ(twin.row.policy, aten.row.policy);
  EXPECT_EQ(twin.row.input_dtypes, aten.row.input_dtypes);
  EXPECT_EQ(twin.row.output_dtype, aten.row.output_dtype);
  EXPECT_EQ(twin.row.casts, aten.row.casts);
  EXPECT_EQ(twin.row.cache_hits, aten.row.cache_hits);
}

class BoxedKernelTest : public AmpTest {
 protected:
  // The fixture's handle ends its initialization before AmpTest drops registrations.
  void TearDown() override {
    handle.deinitialize();
    AmpTest::TearDown();
  }
  void initialize(Options options, std::vector<ModulePtr> models = {}) {
    handle.initialize(std::move(models), {}, quiet(std::move(options)));
  }
  Handle handle;
  at::Tensor x = torch::randn({3, 8}).requires_grad_();
  at::Tensor w = torch::randn({5, 8}).requires_grad_();
  at::Tensor b = torch::randn({5}).requires_grad_();
  // A batch: not a leaf that requires grad, so not taken for a weight at O2.
  at::Tensor batch = torch::randn({3, 8});
};

TEST_F(BoxedKernelTest, LowerPrecisionCastsInputsAndWeights) {
  register_half_function("amp_twin::linear");
  initialize(O1);
  const Observed twin = observe([&] { return twin_linear(x, w, b); }, {x, w, b});
  const Observed aten = observe([&] { return at::linear(x, w, b); }, {x, w, b});
  EXPECT_EQ(aten.output.scalar_type(), at::kBFloat16);
  EXPECT_EQ(aten.row.casts, 3);
  expect_same(twin, aten);
}

TEST_F(BoxedKernelTest, LowerPrecisionFollowsTheWeightsAtO2) {
  torch::nn::Linear model(8, 5);
  register_half_function("amp_twin::linear");
  initialize(O2, {model.ptr()});
  ASSERT_EQ(model->weight.scalar_type(), at::kBFloat16);
  const at::Tensor& mw = model->weight;
  const at::Tensor& mb = model->bias;
  const Observed twin = observe([&] { return twin_linear(batch, mw, mb); }, {mw, mb});
  const Observed aten = observe([&] { return at::linear(batch, mw, mb); }, {mw, mb});
  EXPECT_EQ(aten.output.scalar_type(), at::kBFloat16);  // fp32 input meets the bf16 model
  expect_same(twin, aten);
  // A float32 weight (a module kept fp32) keeps the call in float32.
  const Observed twin_fp32 = observe([&] { return twin_linear(x.to(at::kBFloat16), w, b); }, {x, w, b});
  const Observed aten_fp32 = observe([&] { return at::linear(x.to(at::kBFloat16), w, b); }, {x, w, b});
  EXPECT_EQ(aten_fp32.output.scalar_type(), at::kFloat);
  expect_same(twin_fp32, aten_fp32);
}

TEST_F(BoxedKernelTest, Fp32CastsLowPrecisionInputsUp) {
  register_float_function("amp_twin::linear");
  register_float_function("aten::linear");
  initialize(O1);
  const auto xl = x.to(at::kBFloat16), wl = w.to(at::kBFloat16);
  const Observed twin = observe([&] { return twin_linear(xl, wl, b); }, {x, w, b});
  const Observed aten = observe([&] { return at::linear(xl, wl, b); }, {x, w, b});
  EXPECT_EQ(aten.output.scalar_type(), at::kFloat);
  expect_same(twin, aten);
}

TEST_F(BoxedKernelTest, Fp32SetOptDtypeAsksForFloat32UnlessTheCallerChose) {
  register_op("amp_twin::softmax", CastPolicy::kFp32SetOptDtype);
  register_op("aten::softmax.int", CastPolicy::kFp32SetOptDtype);
  initialize(O1);
  const auto xl = x.to(at::kBFloat16);
  const Observed twin = observe([&] { return twin_softmax(xl, 1, std::nullopt); }, {x});
  const Observed aten = observe([&] { return at::softmax(xl, 1, std::nullopt); }, {x});
  EXPECT_EQ(aten.output.scalar_type(), at::kFloat);
  expect_same(twin, aten);
  const Observed twin_chosen = observe([&] { return twin_softmax(xl, 1, at::kBFloat16); }, {x});
  const Observed aten_chosen = observe([&] { return at::softmax(xl, 1, at::kBFloat16); }, {x});
  EXPECT_EQ(aten_chosen.output.scalar_type(), at::kBFloat16);
  expect_same(twin_chosen, aten_chosen);
}

TEST_F(BoxedKernelTest, PromoteWidensTensorLists) {
  register_promote_function("amp_twin::cat");
  initialize(O1);
  const auto low = torch::randn({2, 8}).to(at::kBFloat16);
  const Observed twin = observe([&] { return twin_cat({low, x}); }, {x});
  const Observed aten = observe([&] { return at::cat({low, x}); }, {x});
  EXPECT_EQ(aten.output.scalar_type(), at::kFloat);
  EXPECT_EQ(aten.row.casts, 1);
  expect_same(twin, aten);
  const Observed twin_low = observe([&] { return twin_cat({low, low}); }, {});
  const Observed aten_low = observe([&] { return at::cat({low, low}); }, {});
  EXPECT_EQ(aten_low.output.scalar_type(), at::kBFloat16);
  expect_same(twin_low, aten_low);
}

TEST_F(BoxedKernelTest, MatchParametersCastsActivationsToLowPrecisionParameters) {
  torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({8}));
  register_op("amp_twin::layer_norm", CastPolicy::kMatchParameters);
  initialize(O2, {norm.ptr()});
  ASSERT_EQ(norm->weight.scalar_type(), at::kBFloat16);
  const at::Tensor& nw = norm->weight;
  const at::Tensor& nb = norm->bias;
  const Observed twin = observe([&] { return twin_layer_norm(batch, nw, nb); }, {nw, nb});
  const Observed aten = observe([&] { return at::layer_norm(batch, {8}, nw, nb); }, {nw, nb});
  EXPECT_EQ(aten.output.scalar_type(), at::kBFloat16);
  EXPECT_EQ(aten.row.policy, CastPolicy::kMatchParameters);
  expect_same(twin, aten);
  // float32 parameters (a norm kept fp32): runs as given, bf16 in and out.
  const auto g = torch::ones({8}).requires_grad_(), h = torch::zeros({8}).requires_grad_();
  const Observed twin_fp32 = observe([&] { return twin_layer_norm(batch.to(at::kBFloat16), g, h); }, {g, h});
  const Observed aten_fp32 = observe([&] { return at::layer_norm(batch.to(at::kBFloat16), {8}, g, h); }, {g, h});
  EXPECT_EQ(aten_fp32.output.scalar_type(), at::kBFloat16);
  EXPECT_EQ(aten_fp32.row.casts, 0);
  expect_same(twin_fp32, aten_fp32);
}

TEST_F(BoxedKernelTest, BannedRefusesWithTheSameAdvice) {
  register_op("amp_twin::linear", CastPolicy::kBanned);
  register_op("aten::linear", CastPolicy::kBanned);
  initialize(O1);
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  std::string twin = message([&] { twin_linear(x, w, b); });
  const std::string aten = message([&] { at::linear(x, w, b); });
  EXPECT_THAT(aten, ::testing::HasSubstr("registered as banned"));
  for (size_t at = twin.find("amp_twin::"); at != std::string::npos; at = twin.find("amp_twin::")) {
    twin.replace(at, 10, "aten::");
  }
  EXPECT_EQ(twin, aten);
}

TEST_F(BoxedKernelTest, PassthroughRunsAsGiven) {
  register_half_function("amp_twin::linear");
  register_half_function("aten::linear");
  initialize(O1);
  {
    disable_casts off;  // casting off on this thread: neither kernel runs
    EXPECT_EQ(twin_linear(x, w, b).scalar_type(), at::kFloat);
  }
  register_op("amp_twin::linear", CastPolicy::kPassthrough);
  register_op("aten::linear", CastPolicy::kPassthrough);
  const Observed twin = observe([&] { return twin_linear(x, w, b); }, {x, w, b});
  const Observed aten = observe([&] { return at::linear(x, w, b); }, {x, w, b});
  EXPECT_EQ(aten.output.scalar_type(), at::kFloat);
  EXPECT_EQ(aten.row.casts, 0);
  expect_same(twin, aten);
}

}  // namespace
}  // namespace amp::testing
