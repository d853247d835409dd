// amp::recompute: the same training loop with and without recomputation,
// bit for bit at every level (bf16 and fp16), with dropout, BatchNorm,
// nesting, several outputs, accumulation and two losses; the errors; and
// the memory it saves, measured by the allocator.
#include "test_util.h"

#include <amp/memory.h>

namespace amp::testing {
namespace {

// A pre-norm residual MLP block with dropout; `nested` recomputes its MLP
// again inside the block's own recomputation.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        up(register_module("up", torch::nn::Linear(width, 2 * width))),
        down(register_module("down", torch::nn::Linear(2 * width, width))),
        drop(register_module("drop", torch::nn::Dropout(0.25))) {}
  at::Tensor mlp(const at::Tensor& x) { return down(drop(torch::gelu(up(x)))); }
  at::Tensor forward(const at::Tensor& x, bool nested) {
    const at::Tensor h = ln(x);
    if (!nested) return x + mlp(h);
    auto self = std::dynamic_pointer_cast<BlockImpl>(shared_from_this());
    return x + amp::recompute([self](const at::Tensor& in) { return self->mlp(in); }, h);
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear up, down;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Block);

enum class Recompute { kNone, kBlocks, kNested };

// Input layer, BatchNorm (inside the first recomputed block, so its running
// statistics would move twice if the rerun updated them), two blocks, head.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : in(register_module("in", torch::nn::Linear(12, 16))),
        bn(register_module("bn", torch::nn::BatchNorm1d(16))),
        b1(register_module("b1", Block(16))),
        b2(register_module("b2", Block(16))),
        head(register_module("head", torch::nn::Linear(16, 5))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    auto first = [this](const at::Tensor& t, bool nested) { return b1->forward(torch::relu(bn(t)), nested); };
    auto second = [this](const at::Tensor& t, bool nested) { return b2->forward(t, nested); };
    if (mode == Recompute::kNone) {
      h = second(first(h, false), false);
    } else {
      const bool nested = mode == Recompute::kNested;
      h = amp::recompute(first, h, nested);
      h = amp::recompute(second, h, nested);
    }
    return head(h);
  }
  torch::nn::Linear in;
  torch::nn::BatchNorm1d bn;
  Block b1, b2;
  torch::nn::Linear head;
  Recompute mode = Recompute::kNone;
};
TORCH_MODULE(Net);

struct Trace {
  std::vector<at::Tensor> losses, params, grads, buffers;
};

// Trains a fresh Net (seed 0) for `steps` steps of momentum SGD with
// cross-entropy; dropout draws from the default generator throughout.
Trace train(const amp::Options& options, Recompute mode, int steps = 3) {
  torch::manual_seed(0);
  Net model;
  model->mode = mode;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::Options o = options;
  o.verbosity = 0;
  amp::Handle handle;
  handle.initialize(model, optimizer, o);
  Trace trace;
  for (int step = 0; step < steps; ++step) {
    const at::Tensor x = torch::randn({8, 12});
    const at::Tensor y = torch::randint(0, 5, {8});
    optimizer.zero_grad();
    const at::Tensor loss = torch::cross_entropy_loss(model->forward(x), y);
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    if (step + 1 == steps) {
      for (const auto& p : model->parameters()) trace.grads.push_back(p.grad().clone());
    }
    optimizer.step();
    trace.losses.push_back(loss.detach().clone());
  }
  for (const auto& p : model->parameters()) trace.params.push_back(p.detach().clone());
  for (const auto& b : model->buffers()) trace.buffers.push_back(b.detach().clone());
  return trace;
}

void expect_bit_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(BitEqual(a[i], b[i])) << what << " " << i;
}

struct LevelCase {
  std::string name;
  amp::OptLevel level;
  std::optional<c10::ScalarType> cpu_dtype;
};

class RecomputeLevelTest : public AmpTest, public ::testing::WithParamInterface<LevelCase> {};

TEST_P(RecomputeLevelTest, TrainsBitIdenticallyToTheModelWithoutRecomputation) {
  amp::Options options = GetParam().level;
  options.cpu_dtype = GetParam().cpu_dtype;
  const Trace plain = train(options, Recompute::kNone);
  for (Recompute mode : {Recompute::kBlocks, Recompute::kNested}) {
    const Trace recomputed = train(options, mode);
    expect_bit_equal(plain.losses, recomputed.losses, "loss");
    expect_bit_equal(plain.grads, recomputed.grads, "gradient");
    expect_bit_equal(plain.params, recomputed.params, "parameter");
    expect_bit_equal(plain.buffers, recomputed.buffers, "buffer (BatchNorm statistics)");
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, RecomputeLevelTest,
                         ::testing::Values(LevelCase{"O0", amp::O0, std::nullopt},
                                           LevelCase{"O1", amp::O1, std::nullopt},
                                           LevelCase{"O2", amp::O2, std::nullopt},
                                           LevelCase{"O3", amp::O3, std::nullopt},
                                           LevelCase{"O4", amp::O4, std::nullopt},
                                           LevelCase{"O5", amp::O5, std::nullopt},
                                           LevelCase{"O1_fp16", amp::O1, c10::kHalf},
                                           LevelCase{"O2_fp16", amp::O2, c10::kHalf},
                                           LevelCase{"O3_fp16", amp::O3, c10::kHalf}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace amp::testing
