// SPDX-License-Identifier: BSD-3-Clause
// O2/O5 weights read through views and indices: a forward sees the weights
// in the level's dtype whatever op reads them first, and results never
// depend on the order of ops or on forwards that came before.
#include "test_util.h"

#include <optional>

namespace amp::testing {
namespace {

constexpr int64_t kVocabulary = 11, kContext = 6, kWidth = 8, kBatch = 3;

// A GPT's embedding and tied head: token embedding plus a position table
// sliced to the sequence length (Python's wpe[:T]), a LayerNorm and a
// Linear, logits through the token table transposed.
struct TinyGptImpl : torch::nn::Module {
  explicit TinyGptImpl(bool position_first)
      : position_first(position_first),
        wte(register_parameter("wte", torch::randn({kVocabulary, kWidth}) * 0.5)),
        wpe(register_parameter("wpe", torch::randn({kContext, kWidth}) * 0.5)),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        fc(register_module("fc", torch::nn::Linear(kWidth, kWidth))) {}

  at::Tensor forward(const at::Tensor& ids) {
    const int64_t length = ids.size(1);
    at::Tensor x;
    if (position_first) {  // the slice before any op amp casts
      const at::Tensor positions = wpe.narrow(/*dim=*/0, /*start=*/0, length);
      x = at::embedding(wte, ids) + positions;
    } else {
      const at::Tensor tokens = at::embedding(wte, ids);
      x = tokens + wpe.narrow(/*dim=*/0, /*start=*/0, length);
    }
    x = torch::tanh(fc(ln(x)));
    return at::matmul(x, wte.t());
  }

  bool position_first;
  at::Tensor wte, wpe;
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc;
};
TORCH_MODULE(TinyGpt);

at::Tensor ids_for(int64_t step) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return at::randint(kVocabulary, {kBatch, kContext}, generator, at::kLong);
}

at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& ids) {
  return torch::cross_entropy_loss(logits.reshape({-1, kVocabulary}).to(at::kFloat), ids.roll(1, 1).reshape(-1));
}

struct Variant {
  const char* name;
  OptLevel level;
  bool fused;  // amp's FusedAdam, or LibTorch's Adam
};
void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

// What a few steps leave: each step's loss, the gradients the last step
// took, and the parameters after it.
struct ReadTrace {
  std::vector<at::Tensor> losses, gradients, parameters;
};

// Hooks a test inserts between the steps of a run.
struct Interludes {
  std::function<void(TinyGpt&)> before_step2;  // after step 1's optimizer step
};

ReadTrace train(const Variant& v, bool position_first, bool recomputed, const Interludes& interludes = {}) {
  torch::manual_seed(7);
  TinyGpt model(position_first);
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  if (v.fused) {
    optimizer = std::make_shared<amp::optim::FusedAdam>(model->parameters(), torch::optim::AdamOptions(1e-2));
  } else {
    optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
  }
  Options options = v.level;
  options.verbosity = 0;
  Handle handle;
  handle.initialize(model, optimizer, options);
  ReadTrace trace;
  for (int64_t step = 0; step < 3; ++step) {
    if (step == 1 && interludes.before_step2) interludes.before_step2(model);
    const at::Tensor ids = ids_for(step);
    optimizer->zero_grad();
    at::Tensor logits = recomputed ? amp::recompute([&](const at::Tensor& in) { return model(in); }, ids)
                                   : model(ids);
    at::Tensor loss = loss_of(logits, ids);
    trace.losses.push_back(loss.detach().clone());
    {
      amp::scale_loss scaled(loss, *optimizer);
      scaled.backward();
    }
    if (step == 2) {
      for (const auto& p : model->parameters()) trace.gradients.push_back(p.grad().clone());
    }
    optimizer->step();
  }
  trace.parameters = clones(model->parameters());
  return trace;
}

::testing::AssertionResult SameBits(const ReadTrace& a, const ReadTrace& b) {
  for (auto part : {&ReadTrace::losses, &ReadTrace::gradients, &ReadTrace::parameters}) {
    const std::vector<at::Tensor>& x = a.*part;
    const std::vector<at::Tensor>& y = b.*part;
    if (x.size() != y.size()) return ::testing::AssertionFailure() << x.size() << " vs " << y.size() << " tensors";
    for (size_t i = 0; i < x.size(); ++i) {
      if (auto same = BitEqual(x[i], y[i]); !same) return same << " (tensor " << i << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

class WeightReadsTest : public AmpTest, public ::testing::WithParamInterface<Variant> {};

// The slice taken before or after the embedding, and the forward run under
// amp::recompute or not: the same bits each time.
TEST_P(WeightReadsTest, OrderOfOpsAndRecomputationChangeNoBit) {
  const ReadTrace reference = train(GetParam(), /*position_first=*/false, /*recomputed=*/false);
  EXPECT_TRUE(SameBits(train(GetParam(), /*position_first=*/true, /*recomputed=*/false), reference));
  EXPECT_TRUE(SameBits(train(GetParam(), /*position_first=*/false, /*recomputed=*/true), reference));
  EXPECT_TRUE(SameBits(train(GetParam(), /*position_first=*/true, /*recomputed=*/true), reference));
}

// Forwards that no guard follows change nothing in the next step: a second
// forward, one abandoned by an exception, an evaluation under
// NoGradGuard, and one with gradients on.
TEST_P(WeightReadsTest, ForwardsNoGuardFollowsChangeNoBitOfTheNextStep) {
  const ReadTrace reference = train(GetParam(), /*position_first=*/true, /*recomputed=*/false);
  const at::Tensor ids = ids_for(9);
  const std::vector<std::pair<const char*, std::function<void(TinyGpt&)>>> interludes = {
      {"abandoned by an exception",
       [&](TinyGpt& model) {
         EXPECT_THROW(
             {
               const at::Tensor positions = model->wpe.narrow(0, 0, kContext);
               (void)(at::embedding(model->wte, ids) + positions);
               throw std::runtime_error("a data error half-way");
             },
             std::runtime_error);
       }},
      {"evaluation under NoGradGuard",
       [&](TinyGpt& model) {
         torch::NoGradGuard no_grad;
         model->eval();
         (void)model(ids);
         model->train();
       }},
      {"evaluation with gradients on", [&](TinyGpt& model) { (void)model(ids); }},
  };
  for (const auto& [name, interlude] : interludes) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(SameBits(train(GetParam(), /*position_first=*/true, /*recomputed=*/false, {interlude}), reference));
  }
}

TEST_P(WeightReadsTest, TwoForwardsInOneIterationGiveTheSameBits) {
  torch::manual_seed(7);
  TinyGpt model(/*position_first=*/true);
  amp::optim::FusedAdam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  Handle handle;
  handle.initialize(model, optimizer, quiet(GetParam().level));
  const at::Tensor ids = ids_for(0);
  const at::Tensor first = loss_of(model(ids), ids), second = loss_of(model(ids), ids);
  EXPECT_TRUE(BitEqual(first, second));
}

INSTANTIATE_TEST_SUITE_P(Levels, WeightReadsTest,
                         ::testing::Values(Variant{"O2_Adam", O2, false}, Variant{"O5_Adam", O5, false},
                                           Variant{"O2_FusedAdam", O2, true}, Variant{"O5_FusedAdam", O5, true},
                                           Variant{"O6_FusedAdam", O6, true}),
                         [](const auto& info) { return std::string(info.param.name); });

// A table with a buffer beside its parameter, for reads of both.
struct TableImpl : torch::nn::Module {
  TableImpl()
      : weight(register_parameter("weight", torch::randn({4, 6}))),
        table(register_buffer("table", torch::randn({4, 6}))),
        anchor(register_module("anchor", torch::nn::Linear(6, 6))) {}
  at::Tensor weight, table;
  torch::nn::Linear anchor;
};
TORCH_MODULE(Table);

struct Read {
  const char* name;
  std::function<at::Tensor(const at::Tensor&)> read;
};

// Every view and indexed read of ATen the scenarios draw, on a resting
// weight or buffer as a forward's first op: the low dtype.
std::vector<Read> reads() {
  using torch::indexing::Slice;
  const at::Tensor rows = torch::tensor({2, 0}, at::kLong);
  return {
      {"narrow", [](const at::Tensor& w) { return w.narrow(0, 1, 2); }},
      {"narrow.Tensor", [](const at::Tensor& w) { return w.narrow(0, torch::tensor(1), 2); }},
      {"slice", [](const at::Tensor& w) { return w.index({Slice(0, 2)}); }},
      {"select", [](const at::Tensor& w) { return w[1]; }},
      {"t", [](const at::Tensor& w) { return w.t(); }},
      {"mT", [](const at::Tensor& w) { return w.mT(); }},
      {"transpose", [](const at::Tensor& w) { return w.transpose(0, 1); }},
      {"swapaxes", [](const at::Tensor& w) { return w.swapaxes(0, 1); }},
      {"permute", [](const at::Tensor& w) { return w.permute({1, 0}); }},
      {"movedim", [](const at::Tensor& w) { return w.movedim(0, 1); }},
      {"view", [](const at::Tensor& w) { return w.view({2, 12}); }},
      {"view_as", [](const at::Tensor& w) { return w.view_as(torch::empty({6, 4})); }},
      {"reshape", [](const at::Tensor& w) { return w.reshape({-1}); }},
      {"flatten", [](const at::Tensor& w) { return w.flatten(); }},
      {"unflatten", [](const at::Tensor& w) { return w.unflatten(1, {2, 3}); }},
      {"expand", [](const at::Tensor& w) { return w.unsqueeze(0).expand({2, 4, 6}); }},
      {"expand_as", [](const at::Tensor& w) { return w[0].expand_as(torch::empty({3, 6})); }},
      {"broadcast_to", [](const at::Tensor& w) { return w.broadcast_to({2, 4, 6}); }},
      {"as_strided", [](const at::Tensor& w) { return w.as_strided({2, 2}, {6, 1}, 1); }},
      {"unsqueeze", [](const at::Tensor& w) { return w.unsqueeze(1); }},
      {"squeeze", [](const at::Tensor& w) { return w.narrow(0, 0, 1).squeeze(); }},
      {"diagonal", [](const at::Tensor& w) { return w.diagonal(); }},
      {"unfold", [](const at::Tensor& w) { return w.unfold(1, 2, 2); }},
      {"split", [](const at::Tensor& w) { return w.split(2)[1]; }},
      {"split_with_sizes", [](const at::Tensor& w) { return w.split_with_sizes({1, 3})[1]; }},
      {"chunk", [](const at::Tensor& w) { return w.chunk(3, 1)[2]; }},
      {"tensor_split", [](const at::Tensor& w) { return w.tensor_split(2)[0]; }},
      {"unbind", [](const at::Tensor& w) { return w.unbind()[3]; }},
      {"alias", [](const at::Tensor& w) { return at::alias(w); }},
      {"index_select", [rows](const at::Tensor& w) { return w.index_select(0, rows); }},
      {"index", [rows](const at::Tensor& w) { return w.index({rows}); }},
      {"gather", [](const at::Tensor& w) { return w.gather(1, torch::zeros({4, 2}, at::kLong)); }},
      {"take", [rows](const at::Tensor& w) { return w.take(rows); }},
      {"take_along_dim", [](const at::Tensor& w) { return w.take_along_dim(torch::zeros({4, 1}, at::kLong), 1); }},
  };
}

class ReadsAtLevelTest : public AmpTest, public ::testing::WithParamInterface<OptLevel> {};

TEST_P(ReadsAtLevelTest, EveryViewAndIndexedReadOfARestingWeightGivesTheLowDtype) {
  for (const Read& r : reads()) {
    for (const bool buffer : {false, true}) {
      SCOPED_TRACE(std::string(r.name) + (buffer ? " of a buffer" : " of a parameter"));
      Table model;
      torch::optim::SGD optimizer(model->parameters(), 0.1);
      Handle handle;
      handle.initialize(model, optimizer, quiet(GetParam()));
      const at::Tensor& tensor = buffer ? model->table : model->weight;
      ASSERT_EQ(tensor.scalar_type(), at::kFloat);  // at rest
      {
        torch::NoGradGuard no_grad;  // reads under no_grad see the float32 masters
        EXPECT_EQ(r.read(tensor).scalar_type(), at::kFloat);
      }
      const at::Tensor read = r.read(tensor);
      EXPECT_EQ(read.scalar_type(), at::kBFloat16);
      EXPECT_EQ(model->anchor->weight.scalar_type(), at::kBFloat16);  // the whole model entered
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, ReadsAtLevelTest, ::testing::Values(O2, O5),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// A graph recorded over resting (float32) weights by an op amp does not
// see, still alive when the model lowers, would add float32 gradients to the
// forward's: amp says so, once, naming the weight. Reads under NoGradGuard,
// and graphs gone before the forward, are fine.
class FloatReadsTest : public AmpTest {};

TEST_F(FloatReadsTest, AGraphOverRestingWeightsStillAliveWhenTheyLowerIsReportedOnce) {
  LogRecorder log;
  torch::manual_seed(7);
  TinyGpt model(/*position_first=*/false);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  Handle handle;
  handle.initialize(model, optimizer, quiet(O2));
  const at::Tensor ids = ids_for(0);
  auto step = [&] {
    optimizer.zero_grad();
    at::Tensor loss = loss_of(model(ids), ids);
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  };
  {
    torch::NoGradGuard no_grad;
    (void)model->fc->weight.pow(2).sum();
  }
  step();
  (void)model->fc->weight.pow(2).sum().item<float>();  // its graph is gone at once
  step();
  EXPECT_TRUE(log.take().empty());

  for (int live = 0; live < 2; ++live) {
    [[maybe_unused]] const at::Tensor penalty = model->fc->weight.pow(2).sum();  // float32: fc rests
    step();
  }
  const std::vector<LogEvent> events = log.take();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].code, "weight_read_in_float32");
  EXPECT_THAT(events[0].message, ::testing::HasSubstr("'fc.weight'"));
  EXPECT_THAT(events[0].message, ::testing::HasSubstr("NoGradGuard"));
}

}  // namespace
}  // namespace amp::testing
