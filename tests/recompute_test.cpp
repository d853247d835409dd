// SPDX-License-Identifier: BSD-3-Clause
// amp::recompute: the same training loop with and without recomputation,
// bit for bit at every level (bf16 and fp16), with dropout, BatchNorm,
// nesting, several outputs, accumulation and two losses; the errors; and
// the memory it saves, measured by the allocator.
#include "test_util.h"

#include "autograd/accumulator_hooks.h"

#include <amp/memory.h>
#include <amp/selective_recompute.h>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/cuda.h>

#include <cstdio>
#include <limits>

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

// kKeep*: the blocks recomputed selectively (amp::Keep).
enum class Recompute { kNone, kBlocks, kNested, kKeepGemms, kKeepSeveralOps, kKeepWhen };

// What the blocks keep in each selective mode: the GEMMs; ops of several
// kinds (a multi-output one, native_layer_norm, among them); the up
// projections' GEMMs alone, chosen per call.
amp::Keep keep_of(Recompute mode) {
  switch (mode) {
    case Recompute::kKeepGemms: return amp::Keep::gemm_outputs();
    case Recompute::kKeepSeveralOps: return amp::Keep::ops({"aten::addmm", "aten::gelu", "aten::native_layer_norm"});
    case Recompute::kKeepWhen:
      return amp::Keep::when({"aten::addmm"}, [](const amp::Keep::Call& call) {
        return call.inputs.size() == 3 && call.inputs[2].size(1) > call.inputs[1].size(1);  // widens: up
      });
    default: return amp::Keep::nothing();
  }
}

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
      const amp::Keep keep = keep_of(mode);
      h = amp::recompute(keep, first, h, nested);
      h = amp::recompute(keep, second, h, nested);
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

struct RecomputeTrace {
  std::vector<at::Tensor> losses, params, grads, buffers;
};

// Trains a fresh Net (seed 0) for `steps` steps of momentum SGD with
// cross-entropy; dropout draws from the default generator throughout.
RecomputeTrace train(const amp::Options& options, Recompute mode, int steps = 3, c10::Device device = c10::kCPU) {
  torch::manual_seed(0);
  if (device.is_cuda()) torch::cuda::manual_seed_all(0);
  Net model;
  model->to(device);
  model->mode = mode;
  // O6 rounds its updates stochastically in amp's fused SGD (the same step).
  const torch::optim::SGDOptions sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  std::unique_ptr<torch::optim::SGD> made =
      options.opt_level == amp::OptLevel::O6 ? std::make_unique<amp::optim::FusedSGD>(model->parameters(), sgd)
                                             : std::make_unique<torch::optim::SGD>(model->parameters(), sgd);
  torch::optim::SGD& optimizer = *made;
  amp::Options o = options;
  o.verbosity = 0;
  amp::Handle handle;
  handle.initialize(model, optimizer, o);
  RecomputeTrace trace;
  for (int step = 0; step < steps; ++step) {
    const at::Tensor x = torch::randn({8, 12}).to(device);
    const at::Tensor y = torch::randint(0, 5, {8}).to(device);
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

class RecomputeLevelTest : public AmpTest, public ::testing::WithParamInterface<LevelCase> {};

TEST_P(RecomputeLevelTest, TrainsBitIdenticallyToTheModelWithoutRecomputation) {
  const amp::Options options = GetParam().options();
  const RecomputeTrace plain = train(options, Recompute::kNone);
  for (Recompute mode : {Recompute::kBlocks, Recompute::kNested, Recompute::kKeepGemms, Recompute::kKeepSeveralOps,
                         Recompute::kKeepWhen}) {
    SCOPED_TRACE("mode " + std::to_string(static_cast<int>(mode)));
    const RecomputeTrace recomputed = train(options, mode);
    expect_bit_equal(plain.losses, recomputed.losses, "loss");
    expect_bit_equal(plain.grads, recomputed.grads, "gradient");
    expect_bit_equal(plain.params, recomputed.params, "parameter");
    expect_bit_equal(plain.buffers, recomputed.buffers, "buffer (BatchNorm statistics)");
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, RecomputeLevelTest, every_level(), level_case_name);

// On the GPU backward runs on autograd's device thread, and dropout draws
// from the CUDA generator: the rerun takes both from its forward (and, kept
// selectively, the outputs forward kept).
TEST_F(AmpTest, OnCudaRecomputedTrainingIsBitIdentical) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  for (amp::OptLevel level : {amp::O1, amp::O2, amp::O5}) {
    const RecomputeTrace plain = train(level, Recompute::kNone, 3, c10::kCUDA);
    for (Recompute mode : {Recompute::kNested, Recompute::kKeepGemms, Recompute::kKeepSeveralOps}) {
      const RecomputeTrace recomputed = train(level, mode, 3, c10::kCUDA);
      const std::string what = std::string(to_string(level)) + " mode " + std::to_string(static_cast<int>(mode));
      expect_bit_equal(plain.grads, recomputed.grads, what.c_str());
      expect_bit_equal(plain.params, recomputed.params, what.c_str());
      expect_bit_equal(plain.buffers, recomputed.buffers, what.c_str());
    }
  }
}

// --- The block's contract -------------------------------------------------------

using Recomputed = std::function<at::Tensor(const at::Tensor&)>;

TEST_F(AmpTest, OutputsHangOnOneRecomputeNodeAndNoGradIsAPlainCall) {
  torch::nn::Linear fc(4, 4);
  int calls = 0;
  auto block = [&](const at::Tensor& x) {
    ++calls;
    return torch::tanh(fc(x));
  };
  const at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  const at::Tensor y = amp::recompute(block, x);
  ASSERT_TRUE(y.grad_fn());
  EXPECT_EQ(y.grad_fn()->name(), "amp::RecomputeBackward");
  EXPECT_EQ(calls, 1);
  y.sum().backward();
  EXPECT_EQ(calls, 2);  // the rerun
  {
    torch::NoGradGuard no_grad;
    const at::Tensor z = amp::recompute(block, x);
    EXPECT_FALSE(z.requires_grad());
  }
  EXPECT_EQ(calls, 3);
  const at::Tensor ids = torch::randint(0, 4, {2});
  EXPECT_FALSE(amp::recompute([](const at::Tensor& i) { return i * 2; }, ids).requires_grad());
}

// Tensor and non-tensor arguments, an integer input, an input without
// grad, several outputs: the same gradients as the plain call at O1 (fp16),
// where the weights reach the block through the cast cache.
TEST_F(AmpTest, SeveralOutputsAndNonTensorArgumentsBackpropagateAsThePlainCall) {
  auto run = [](bool recompute) {
    torch::manual_seed(0);
    torch::nn::Embedding embed(10, 6);
    torch::nn::Linear fc(6, 6);
    torch::optim::SGD optimizer(std::vector<at::Tensor>{embed->weight, fc->weight, fc->bias}, 0.1);
    Options options = O1;
    options.cpu_dtype = c10::kHalf;
    options.loss_scale = LossScale::Static(128);
    options.verbosity = 0;
    Handle handle;
    handle.initialize({embed, fc}, {optimizer}, options);
    const at::Tensor ids = torch::randint(0, 10, {3});
    const at::Tensor x = torch::randn({3, 6}, torch::requires_grad());
    const at::Tensor bias = torch::randn({6});  // needs no gradient
    auto block = [embed, fc](const at::Tensor& ids, const at::Tensor& x, double scale, const at::Tensor& bias,
                             const std::string& how) mutable {
      const at::Tensor h = fc(embed(ids) + x) * scale + bias;
      return std::make_tuple(how == "tanh" ? torch::tanh(h) : h, fc(h).relu());
    };
    auto [a, b] = recompute ? amp::recompute(block, ids, x, 0.5, bias, std::string("tanh"))
                            : block(ids, x, 0.5, bias, "tanh");
    const at::Tensor loss = a.to(at::kFloat).sum() + (b.to(at::kFloat) * b.to(at::kFloat)).sum();
    {
      scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    return std::vector<at::Tensor>{x.grad(), embed->weight.grad(), fc->weight.grad(), fc->bias.grad(), loss};
  };
  expect_bit_equal(run(false), run(true), "gradient");
}

// Two micro-batches with delay_unscale, then a step: O2 (fp32 masters) and
// O1 in fp16 (dynamic scale).
TEST_F(AmpTest, GradientAccumulationOverMicroBatchesIsBitIdentical) {
  for (amp::OptLevel level : {amp::O1, amp::O2}) {
    auto run = [&](Recompute mode) {
      torch::manual_seed(0);
      Net model;
      model->mode = mode;
      torch::optim::Adam optimizer(model->parameters(), 1e-2);
      Options options = level;
      options.cpu_dtype = level == amp::O1 ? std::optional<c10::ScalarType>(c10::kHalf) : std::nullopt;
      options.verbosity = 0;
      Handle handle;
      handle.initialize(model, optimizer, options);
      for (int step = 0; step < 2; ++step) {
        optimizer.zero_grad();
        for (int micro = 0; micro < 2; ++micro) {
          const at::Tensor loss =
              torch::cross_entropy_loss(model->forward(torch::randn({6, 12})), torch::randint(0, 5, {6}));
          scale_loss scaled(loss, optimizer, {.delay_unscale = micro == 0});
          scaled.backward();
        }
        optimizer.step();
      }
      std::vector<at::Tensor> out;
      for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
      return out;
    };
    expect_bit_equal(run(Recompute::kNone), run(Recompute::kNested), to_string(level));
  }
}

// A trunk shared by two losses with their own scalers (num_losses = 2): the
// first guard's backward retains the graph, and its end clears the cast
// cache before the second backward reruns the trunk.
TEST_F(AmpTest, TwoLossesThroughARetainedRecomputedTrunkAreBitIdentical) {
  auto run = [](bool recompute) {
    torch::manual_seed(0);
    Block trunk(8);
    torch::nn::Linear head1(8, 1), head2(8, 1);
    torch::optim::SGD optimizer(trunk->parameters(), 0.1), heads(std::vector<at::Tensor>{}, 0.1);
    for (auto* head : {&head1, &head2}) heads.add_param_group(torch::optim::OptimizerParamGroup((*head)->parameters()));
    Options options = O1;
    options.cpu_dtype = c10::kHalf;
    options.loss_scale = LossScale::Static(128);
    options.num_losses = 2;
    options.verbosity = 0;
    Handle handle;
    handle.initialize({trunk, head1, head2}, {optimizer, heads}, options);
    const at::Tensor x = torch::randn({4, 8});
    const at::Tensor h = recompute ? amp::recompute([trunk](const at::Tensor& in) mutable { return trunk->forward(in, true); }, x)
                                   : trunk->forward(x, true);
    const at::Tensor loss1 = head1(h).to(at::kFloat).pow(2).mean(), loss2 = head2(h).to(at::kFloat).abs().mean();
    {
      scale_loss scaled(loss1, {optimizer, heads}, {.loss_id = 0});
      scaled.backward(/*retain_graph=*/true);
    }
    {
      scale_loss scaled(loss2, {optimizer, heads}, {.loss_id = 1});
      scaled.backward();
    }
    std::vector<at::Tensor> grads;
    for (const auto& p : trunk->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  expect_bit_equal(run(false), run(true), "trunk gradient");
}

// Gradient penalties: backward through the block's own backward, whose
// graph leads through the rerun's stand-ins to the block's argument (made
// by an op before it) and, at O1, to the cast cache's copies. Equal to the
// plain block up to rounding: the first-order path and the double-backward
// path add into the gradients in another order (at O1 in bfloat16, whose
// rounding is 2^-8 relative).
TEST_F(AmpTest, CreateGraphDifferentiatesThroughTheRerun) {
  for (amp::OptLevel level : {amp::O0, amp::O1}) {
    auto run = [&](bool recompute) {
      torch::manual_seed(0);
      Block block(8);
      torch::optim::SGD optimizer(block->parameters(), 0.1);
      Options options = level;
      options.loss_scale = LossScale::Static(1);  // x0 is no parameter: its gradient stays scaled
      options.verbosity = 0;
      Handle handle;
      handle.initialize(block, optimizer, options);
      const at::Tensor x0 = torch::randn({4, 8}, torch::requires_grad());
      const at::Tensor x = x0 * 3;
      auto f = [block](const at::Tensor& in) mutable { return torch::tanh(block->forward(in, false)); };
      const at::Tensor y = recompute ? amp::recompute(f, x) : f(x);
      const at::Tensor dx = torch::autograd::grad({y.to(at::kFloat).sum()}, {x}, {}, true, true)[0];
      const at::Tensor loss = y.to(at::kFloat).pow(2).mean() + dx.pow(2).sum();
      {
        scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      std::vector<at::Tensor> out{dx.detach(), x0.grad()};
      for (const auto& p : block->parameters()) out.push_back(p.grad().clone());
      return out;
    };
    const std::vector<at::Tensor> plain = run(false), recomputed = run(true);
    EXPECT_TRUE(BitEqual(plain[0], recomputed[0])) << to_string(level) << ": first-order gradient";
    const double tolerance = level == amp::O1 ? 2e-2 : 1e-5;  // of each tensor's largest magnitude
    for (size_t i = 0; i < plain.size(); ++i) {
      const double scale = plain[i].abs().max().item<double>();
      EXPECT_LE((plain[i] - recomputed[i]).abs().max().item<double>(), tolerance * scale) << to_string(level) << " " << i;
    }
  }
}

TEST_F(AmpTest, HooksOnWeightsRunOnceAndSequentialSegmentsMatchForward) {
  auto run = [](bool recompute, int* hook_calls) {
    torch::manual_seed(0);
    torch::nn::Sequential layers(torch::nn::Linear(6, 8), torch::nn::BatchNorm1d(8), torch::nn::ReLU(),
                                 torch::nn::Dropout(0.2), torch::nn::Linear(8, 8), torch::nn::Tanh(),
                                 torch::nn::Linear(8, 3));
    torch::optim::SGD optimizer(layers->parameters(), 0.1);
    Options options = O1;
    options.verbosity = 0;
    Handle handle;
    handle.initialize(layers, optimizer, options);
    layers[0]->as<torch::nn::Linear>()->weight.register_hook([hook_calls](const at::Tensor& g) {
      ++*hook_calls;
      return g * 2;
    });
    const at::Tensor x = torch::randn({5, 6});
    const at::Tensor out = recompute ? amp::recompute_sequential(layers, 3, x) : layers->forward(x);
    {
      scale_loss scaled(out.to(at::kFloat).pow(2).mean(), optimizer);
      scaled.backward();
    }
    std::vector<at::Tensor> result;
    for (const auto& p : layers->parameters()) result.push_back(p.grad().clone());
    for (const auto& b : layers->buffers()) result.push_back(b.clone());
    return result;
  };
  int plain_calls = 0, recomputed_calls = 0;
  expect_bit_equal(run(false, &plain_calls), run(true, &recomputed_calls), "gradient or buffer");
  EXPECT_EQ(plain_calls, 1);
  EXPECT_EQ(recomputed_calls, 1);
}

// --- Overflow provenance ---------------------------------------------------------


// An inf made inside a recomputed block, in forward or in backward, is
// reported as if the block were not recomputed: the same op or node, its
// module, its dtype, and the same gradients.
TEST_F(AmpTest, AnOverflowInsideARecomputedBlockIsNamedAsWithoutRecomputation) {
  for (bool in_forward : {true, false}) {
    auto report_of = [&](bool recompute) {
      torch::manual_seed(0);
      TinyNet model;
      torch::nn::Linear head(4, 2);
      torch::optim::SGD optimizer(model->parameters(), 0.1);
      Options options = O1;
      options.verbosity = 0;
      options.overflow_provenance = true;
      options.loss_scale = LossScale::Dynamic();
      Handle handle;
      handle.initialize({model, head}, {optimizer}, options);
      auto block = [model, in_forward](const at::Tensor& x) mutable {
        at::Tensor h = torch::relu(model->fc1(x));
        h = in_forward ? h * kInf : InfInBackward::apply(h);
        return model->fc2(h);
      };
      const at::Tensor x = torch::randn({4, 8});
      const at::Tensor out = recompute ? amp::recompute(block, x) : block(x);
      optimizer.zero_grad();
      {
        scale_loss scaled(head(out).to(at::kFloat).sum(), optimizer);
        scaled.backward();
      }
      optimizer.step();
      return last_overflow(optimizer);
    };
    const std::optional<OverflowReport> plain = report_of(false), recomputed = report_of(true);
    ASSERT_TRUE(plain.has_value() && recomputed.has_value());
    const auto& expected = in_forward ? plain->forward : plain->backward;
    const auto& got = in_forward ? recomputed->forward : recomputed->backward;
    ASSERT_TRUE(expected.has_value() && got.has_value()) << (in_forward ? "forward" : "backward");
    EXPECT_EQ(got->op, expected->op);
    EXPECT_EQ(got->module, expected->module);
    EXPECT_EQ(got->module, "model0.fc1");
    EXPECT_EQ(got->dtype, expected->dtype);
    EXPECT_EQ(got->input_non_finite, expected->input_non_finite);
    EXPECT_EQ(recomputed->non_finite_gradients, plain->non_finite_gradients);
  }
}

// --- Errors -------------------------------------------------------------------

TEST_F(AmpTest, RecomputeRefusesWhatItCannotRerunFaithfully) {
  torch::nn::Linear fc(4, 4);
  const at::Tensor x = torch::randn({2, 4}, torch::requires_grad());
  const at::Tensor h = x * 2;

  // An argument changed in place between forward and backward.
  const at::Tensor held = h.detach().clone();
  const at::Tensor y = amp::recompute([fc](const at::Tensor& in) mutable { return fc(in); }, held);
  held.add_(1);
  EXPECT_AMP_ERROR(y.sum().backward(), "tensor argument 0 of a recomputed block was changed in place");

  // The block changes its argument.
  const at::Tensor arg = torch::randn({2, 4});
  EXPECT_AMP_ERROR(amp::recompute([fc](const at::Tensor& in) mutable { return fc(in.mul_(2)); }, arg),
                   "changed its tensor argument 0 in place");

  // A tensor with history captured instead of passed.
  EXPECT_AMP_ERROR(amp::recompute([fc, h](const at::Tensor& in) mutable { return fc(in) + h; }, torch::randn({2, 4})),
                   "Pass it to amp::recompute as an argument");

  // Backward twice through a freed block.
  const at::Tensor z = amp::recompute([fc](const at::Tensor& in) mutable { return fc(in); }, x);
  z.sum().backward();
  EXPECT_AMP_ERROR(z.sum().backward(), "Pass retain_graph=true");

  EXPECT_AMP_ERROR(amp::recompute_sequential(torch::nn::Sequential(torch::nn::ReLU()), 0, x), "segments must be >= 1");
  EXPECT_AMP_ERROR(amp::recompute_sequential(torch::nn::Sequential(), 1, x), "empty Sequential");
}

// --- In slices of the batch -----------------------------------------------------

// Three blocks with dropout, run in `slices` slices of the batch either by
// amp::recompute_in_slices or by hand (each slice through the blocks
// without recomputation, the outputs concatenated): the same dropout masks,
// outputs and gradients.
std::vector<at::Tensor> sliced_step(Options options, int64_t slices, bool recompute, int64_t rows,
                                    c10::Device device = c10::kCPU) {
  torch::manual_seed(0);
  if (device.is_cuda()) torch::cuda::manual_seed_all(0);
  torch::nn::ModuleList blocks;
  for (int i = 0; i < 3; ++i) blocks->push_back(Block(16));
  blocks->to(device);
  torch::optim::SGD optimizer(blocks->parameters(), 0.1);
  options.verbosity = 0;
  Handle handle;
  handle.initialize(blocks, optimizer, options);
  const at::Tensor x = torch::randn({rows, 16}, torch::device(device).requires_grad(true));
  auto run = [blocks](const at::Tensor& in) {
    at::Tensor h = in;
    for (size_t i = 0; i < blocks->size(); ++i) h = blocks->ptr<BlockImpl>(i)->forward(h, false);
    return h;
  };
  at::Tensor y;
  if (recompute) {
    y = amp::recompute_in_slices(slices, run, x);
  } else {
    std::vector<at::Tensor> pieces;
    for (const at::Tensor& piece : x.chunk(slices)) pieces.push_back(run(piece));
    y = torch::cat(pieces);
  }
  const at::Tensor loss = y.to(at::kFloat).pow(2).mean();
  {
    scale_loss scaled(loss, optimizer);
    scaled.backward();
  }
  std::vector<at::Tensor> out = {y.detach().clone(), x.grad().clone()};
  for (const auto& p : blocks->parameters()) out.push_back(p.grad().clone());
  return out;
}

TEST_F(AmpTest, RecomputeInSlicesIsTheBlockRunOnEachSliceBitForBit) {
  Options fp16 = O1;
  fp16.cpu_dtype = c10::kHalf;
  fp16.loss_scale = LossScale::Static(128);
  for (const auto& [name, options] : std::vector<std::pair<std::string, Options>>{
           {"O0", O0}, {"O1 bf16", O1}, {"O1 fp16", fp16}, {"O2", O2}, {"O5", O5}}) {
    SCOPED_TRACE(name);
    // 10 rows in 4 slices: 3, 3, 3 and 1.
    expect_bit_equal(sliced_step(options, 4, true, 10), sliced_step(options, 4, false, 10), "output or gradient");
  }
}

// On the GPU: backward on autograd's device thread, dropout from the CUDA
// generator, the slices' weight gradients added on the device.
TEST_F(AmpTest, OnCudaRecomputeInSlicesIsTheBlockRunOnEachSliceBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine; runs on the GPU machine (tools/gpu_run.sh)";
  for (const auto& [name, options] : std::vector<std::pair<std::string, Options>>{{"O1", O1}, {"O2", O2}, {"O5", O5}}) {
    SCOPED_TRACE(name);
    expect_bit_equal(sliced_step(options, 4, true, 10, c10::kCUDA), sliced_step(options, 4, false, 10, c10::kCUDA),
                     "output or gradient");
  }
}

// Against the whole batch at once, in float64 without dropout: equal but for
// the order in which each weight's gradient sums the slices' parts.
TEST_F(AmpTest, RecomputeInSlicesMatchesTheWholeBlockInFloat64) {
  auto step = [](int64_t slices) {
    torch::manual_seed(0);
    Block block(16);
    block->to(torch::kDouble);
    block->eval();  // no dropout: the whole batch and its slices draw alike
    const at::Tensor x = torch::randn({12, 16}, torch::dtype(torch::kDouble).requires_grad(true));
    auto run = [block](const at::Tensor& in) mutable { return block->forward(in, false); };
    const at::Tensor y = slices > 1 ? amp::recompute_in_slices(slices, run, x) : run(x);
    y.pow(2).sum().backward();
    std::vector<at::Tensor> out = {y.detach(), x.grad()};
    for (const auto& p : block->parameters()) out.push_back(p.grad());
    return out;
  };
  const auto whole = step(1), sliced = step(3);
  ASSERT_EQ(whole.size(), sliced.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_TRUE(torch::allclose(sliced[i], whole[i], 1e-12, 1e-12)) << "tensor " << i;
  }
}

TEST_F(AmpTest, RecomputeInSlicesRunsEachSliceOnceAndNoGradIsAPlainCall) {
  torch::nn::Linear fc(4, 4);
  std::vector<int64_t> rows;
  auto block = [&](const at::Tensor& x) {
    rows.push_back(x.size(0));
    return torch::tanh(fc(x));
  };
  const at::Tensor x = torch::randn({5, 4}, torch::requires_grad());
  const at::Tensor y = amp::recompute_in_slices(2, block, x);
  EXPECT_EQ(rows, (std::vector<int64_t>{3, 2}));
  y.sum().backward();
  EXPECT_EQ(rows, (std::vector<int64_t>{3, 2, 2, 3}));  // each slice again, the last first
  rows.clear();
  {
    torch::NoGradGuard no_grad;
    EXPECT_FALSE(amp::recompute_in_slices(2, block, x).requires_grad());
  }
  EXPECT_EQ(rows, (std::vector<int64_t>{5}));
}

TEST_F(AmpTest, RecomputeInSlicesRefusesWhatCannotRunInSlices) {
  torch::nn::Linear fc(4, 4);
  auto block = [fc](const at::Tensor& in) mutable { return fc(in); };
  const at::Tensor x = torch::randn({4, 4}, torch::requires_grad());
  EXPECT_AMP_ERROR(amp::recompute_in_slices(0, block, x), "slices must be >= 1");
  EXPECT_AMP_ERROR(amp::recompute_in_slices(2, block, at::Tensor()), "an undefined tensor");
  EXPECT_AMP_ERROR(amp::recompute_in_slices(2, block, torch::tensor(1.0)), "a tensor without dimensions");
  // A block that mixes rows (a sum over the batch) cannot run in slices.
  EXPECT_AMP_ERROR(amp::recompute_in_slices(2, [fc](const at::Tensor& in) mutable { return fc(in).sum(0, true); }, x),
                   "must map each row of its input to the same row of its output");
  EXPECT_FALSE(fc->weight.grad().defined());
}

// --- Memory -----------------------------------------------------------------------

// Bytes held during backward: without recomputation every block's
// activations wait for it; with it only the blocks' inputs, plus one
// block's activations at a time. The CPU kernels' own buffers during a
// block's backward differ between processors (about 1 MB here, 4 MB on an
// H100 host's CPU, where 6 blocks gave a ratio of 0.62): 12 blocks let the
// saved activations outweigh them on both.
// `model` at O1 with SGD, the step's bytes counted from construction on.
template <class Model>
struct CountedStep {
  torch::optim::SGD optimizer;
  Handle handle;
  int64_t before = 0;
  explicit CountedStep(Model& model) : optimizer(model->parameters(), 0.1) {
    Options options = O1;
    options.verbosity = 0;
    handle.initialize(model, optimizer, options);
    optimizer.zero_grad();
    reset_peak_allocated();
    before = allocated_bytes().current;
  }
  int64_t held() const { return allocated_bytes().current - before; }
  int64_t peak() const { return allocated_bytes().peak - before; }
};

TEST_F(AmpTest, RecomputationHoldsMeasurablyFewerBytesDuringBackward) {
  amp::track_allocations();
  auto peak_of_step = [](bool recompute) {
    torch::manual_seed(0);
    torch::nn::ModuleList blocks;
    for (int i = 0; i < 12; ++i) blocks->push_back(Block(64));
    const at::Tensor x = torch::randn({1024, 64});
    CountedStep step(blocks);
    at::Tensor h = x;
    for (size_t i = 0; i < blocks->size(); ++i) {
      const auto b = blocks->ptr<BlockImpl>(i);
      h = recompute ? amp::recompute([b](const at::Tensor& in) { return b->forward(in, false); }, h)
                    : b->forward(h, false);
    }
    {
      scale_loss scaled(h.to(at::kFloat).pow(2).mean(), step.optimizer);
      scaled.backward();
    }
    return step.peak();
  };
  const int64_t plain = peak_of_step(false), recomputed = peak_of_step(true);
  std::printf("peak bytes above the step's start: %lld without recomputation, %lld with\n",
              static_cast<long long>(plain), static_cast<long long>(recomputed));
  EXPECT_LT(recomputed, plain * 6 / 10);
}

// In slices, a block's rerun holds one slice's activations: what backward
// holds above what forward kept falls with the slices (the weights' and the
// input's gradients, whole in both, aside).
TEST_F(AmpTest, RecomputeInSlicesHoldsOneSlicesActivations) {
  amp::track_allocations();
  struct Held {
    int64_t after_forward = 0, peak = 0;
  };
  auto run_step = [](int64_t slices) {
    torch::manual_seed(0);
    Block block(64);
    const at::Tensor x = torch::randn({4096, 64});
    CountedStep step(block);
    auto run = [block](const at::Tensor& in) mutable { return block->forward(in, false); };
    const at::Tensor y = slices > 1 ? amp::recompute_in_slices(slices, run, x) : amp::recompute(run, x);
    Held held;
    held.after_forward = step.held();
    {
      scale_loss scaled(y.sum(), step.optimizer);  // its gradient an expanded scalar: no bytes of its own
      scaled.backward();
    }
    held.peak = step.peak();
    return held;
  };
  const Held whole = run_step(1), sliced = run_step(8);
  const int64_t whole_rerun = whole.peak - whole.after_forward, sliced_rerun = sliced.peak - sliced.after_forward;
  std::printf("backward above forward's bytes: %lld whole, %lld in 8 slices\n", static_cast<long long>(whole_rerun),
              static_cast<long long>(sliced_rerun));
  // Forward keeps the input, the output and each slice's node its generator state.
  const int64_t rng_state_bytes = at::detail::getDefaultCPUGenerator().get_state().nbytes();
  EXPECT_EQ(sliced.after_forward, whole.after_forward + 7 * rng_state_bytes);
  EXPECT_LT(sliced_rerun, whole_rerun / 4);
}

// Two levels (sqrt-decomposition, as the memory benchmark's deepest rows):
// runs of recomputed blocks, each run recomputed as one. After forward only
// the runs' inputs are kept; a run's rerun keeps its blocks' inputs while
// backward goes through it. Gradients are the one-level ones bit for bit
// (dropout's masks drawn again alike at both levels).
TEST_F(AmpTest, RunsOfRecomputedBlocksKeepOnlyTheRunsInputs) {
  amp::track_allocations();
  constexpr int kBlocks = 12, kRun = 4;
  const at::Tensor x = torch::randn({1024, 64});
  const int64_t input_bytes = x.nbytes();
  struct Held {
    int64_t after_forward = 0, peak = 0;
    std::vector<at::Tensor> grads;
  };
  auto step = [&](int run, OptLevel level) {
    torch::manual_seed(0);
    torch::nn::ModuleList blocks;
    for (int i = 0; i < kBlocks; ++i) blocks->push_back(Block(64));
    torch::optim::SGD optimizer(blocks->parameters(), 0.1);
    Options options = level;
    options.verbosity = 0;
    Handle handle;
    handle.initialize(blocks, optimizer, options);
    auto run_blocks = [blocks](size_t begin, size_t end, at::Tensor h) {
      for (size_t i = begin; i < end; ++i) {
        const auto b = blocks->ptr<BlockImpl>(i);
        h = amp::recompute([b](const at::Tensor& in) { return b->forward(in, false); }, h);
      }
      return h;
    };
    Held held;
    optimizer.zero_grad();
    reset_peak_allocated();
    const int64_t before = allocated_bytes().current;
    at::Tensor h = x;
    if (run == 1) {
      h = run_blocks(0, kBlocks, h);
    } else {
      for (size_t begin = 0; begin < kBlocks; begin += run) {
        h = amp::recompute([run_blocks, begin, run](const at::Tensor& in) { return run_blocks(begin, begin + run, in); },
                           h);
      }
    }
    held.after_forward = allocated_bytes().current - before;
    {
      scale_loss scaled(h.to(at::kFloat).pow(2).mean(), optimizer);
      scaled.backward();
    }
    held.peak = allocated_bytes().peak - before;
    for (const auto& p : blocks->parameters()) held.grads.push_back(p.grad().clone());
    return held;
  };
  const Held one_level = step(1, O1), two_levels = step(kRun, O1);
  // One level keeps the inputs of blocks 1..11, two those of blocks 4 and 8;
  // each recompute node also keeps the CPU generator's state for its rerun.
  const int64_t rng_state_bytes = at::detail::getDefaultCPUGenerator().get_state().nbytes();
  std::printf("after forward: %lld bytes with one level, %lld with runs of %d; peak %lld and %lld\n",
              static_cast<long long>(one_level.after_forward), static_cast<long long>(two_levels.after_forward), kRun,
              static_cast<long long>(one_level.peak), static_cast<long long>(two_levels.peak));
  EXPECT_EQ(one_level.after_forward - two_levels.after_forward, 9 * (input_bytes + rng_state_bytes))
      << "forward should keep 9 block inputs (and their nodes' generator states) fewer, and nothing else";
  EXPECT_LT(two_levels.peak, one_level.peak);
  expect_bit_equal(one_level.grads, two_levels.grads, "gradient");
  // With bfloat16 weights (O2) and float32 masters stepped from them (O5), the same.
  for (OptLevel level : {O2, O5}) {
    expect_bit_equal(step(1, level).grads, step(kRun, level).grads, "gradient at O2/O5");
  }
}

// In two levels a run's rerun holds its blocks' reruns. Each block's
// parameter gradients reach their accumulators (where data parallel's
// reduction and the step in backward hook in) as the block's own rerun ends,
// before the next block's begins, not all at the run's end; each
// accumulator runs once a backward. A weight also read outside its run
// waits for the outer backward, which adds both paths first. Gradients are
// those of one level bit for bit.
TEST_F(AmpTest, RunsHandEachBlocksParameterGradientsOnAsTheBlocksRerunEnds) {
  constexpr int kBlocks = 8, kRun = 4, kShared = 6;  // block 6's weight is also read by the loss
  struct Result {
    std::vector<int> calls_of_previous;  // per block: block i-1's calls when i's weight gradient arrived
    std::vector<int> accumulations;      // per parameter
    std::vector<at::Tensor> grads;
  };
  enum class Backward { kGuard, kGuardRetained, kPlain };
  auto step = [&](int run, OptLevel level, Backward how = Backward::kGuard) {
    torch::manual_seed(0);
    torch::nn::ModuleList blocks;
    for (int i = 0; i < kBlocks; ++i) blocks->push_back(torch::nn::Linear(16, 16));
    torch::optim::SGD optimizer(blocks->parameters(), 0.1);
    Handle handle;
    handle.initialize(blocks, optimizer, quiet(level));
    auto calls = std::make_shared<std::vector<int>>(kBlocks, 0);
    auto block = [&blocks, calls](int i) {
      const auto linear = blocks->ptr<torch::nn::LinearImpl>(i);
      return [linear, calls, i](const at::Tensor& in) {
        ++(*calls)[i];
        return torch::relu(linear->forward(in));
      };
    };
    auto run_blocks = [&block](int begin, int end, at::Tensor h) {
      for (int i = begin; i < end; ++i) h = amp::recompute(block(i), h);
      return h;
    };
    at::Tensor h = torch::randn({32, 16});
    if (run == 1) {
      h = run_blocks(0, kBlocks, h);
    } else {
      for (int begin = 0; begin < kBlocks; begin += run) {
        h = amp::recompute([run_blocks, begin, run](const at::Tensor& in) { return run_blocks(begin, begin + run, in); },
                           h);
      }
    }
    const auto shared = blocks->ptr<torch::nn::LinearImpl>(kShared)->weight;
    const at::Tensor loss = h.to(at::kFloat).pow(2).mean() + shared.to(at::kFloat).pow(2).sum() * 1e-3;
    Result result;
    result.calls_of_previous.assign(kBlocks, -1);
    const std::vector<at::Tensor> params = blocks->parameters();
    result.accumulations.assign(params.size(), 0);
    detail::AccumulatorHooks hooks;
    for (size_t k = 0; k < params.size(); ++k) {
      const int i = static_cast<int>(k / 2);  // weight, bias
      EXPECT_TRUE(hooks.add(params[k], [&result, calls, k, i] {
        ++result.accumulations[k];
        if (k % 2 == 0 && i > 0) result.calls_of_previous[i] = (*calls)[i - 1];
      }));
    }
    if (how == Backward::kPlain) {
      loss.backward();
    } else {
      scale_loss scaled(loss, optimizer);
      scaled.backward(/*retain_graph=*/how == Backward::kGuardRetained);
    }
    for (const auto& p : params) result.grads.push_back(p.grad().clone());
    return result;
  };
  // The weights are the graph's leaves: float32 at O0, bfloat16 at O2 and O5.
  // (At O1 a block reads its weights' cast copies, made outside its runs.)
  for (OptLevel level : {O0, O2, O5}) {
    SCOPED_TRACE(to_string(level));
    const Result one = step(1, level), two = step(kRun, level);
    for (int i = 1; i < kBlocks; ++i) {
      SCOPED_TRACE("block " + std::to_string(i));
      // One level: forward, then block i's rerun ends before block i-1's begins.
      EXPECT_EQ(one.calls_of_previous[i], 1);
      if (i % kRun == 0) continue;  // the first block of a run: the run before it has not rerun
      // Two levels: forward, the run's rerun; block i-1's own rerun not yet -
      // except for the weight the loss reads too, which waits for the run.
      EXPECT_EQ(two.calls_of_previous[i], i == kShared ? 3 : 2);
    }
    EXPECT_EQ(two.accumulations, std::vector<int>(2 * kBlocks, 1));
    expect_bit_equal(one.grads, two.grads, "gradient");
  }
  // Not handed on early, with the same bits: a backward that keeps its graph
  // (the run's node may run again, through the edges a hand-on cuts), and a
  // plain backward, outside a guard, whose root amp cannot see.
  for (Backward how : {Backward::kGuardRetained, Backward::kPlain}) {
    SCOPED_TRACE(how == Backward::kPlain ? "plain backward" : "retained graph");
    const Result one = step(1, O0, how), two = step(kRun, O0, how);
    for (int i = 1; i < kBlocks; ++i) {
      if (i % kRun != 0) EXPECT_EQ(two.calls_of_previous[i], 3) << "block " << i;
    }
    EXPECT_EQ(two.accumulations, std::vector<int>(2 * kBlocks, 1));
    expect_bit_equal(one.grads, two.grads, "gradient");
  }
}

}  // namespace
}  // namespace amp::testing

namespace amp::testing {
namespace {

// x -> up -> gelu -> down, its up projection's output changed in place when
// `in_place` (a kept output changed after its op returned).
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() : up(register_module("up", torch::nn::Linear(8, 16))), down(register_module("down", torch::nn::Linear(16, 8))) {}
  at::Tensor forward(const at::Tensor& x, bool in_place) {
    at::Tensor h = up(x);
    if (in_place) h.mul_(0.5);
    return down(torch::gelu(h));
  }
  torch::nn::Linear up, down;
};
TORCH_MODULE(Probe);

// down's weight gradient when up's weight is changed behind autograd's back
// (through .data(), no version counter moves) between forward and backward:
// as forward computed it where the rerun takes up's output from forward,
// different where the rerun computes it again from the changed weight.
at::Tensor down_gradient_after_a_hidden_change(std::optional<amp::Keep> keep, bool in_place) {
  torch::manual_seed(0);
  Probe probe;
  const at::Tensor x = torch::randn({4, 8});
  auto block = [probe, in_place](const at::Tensor& in) mutable { return probe->forward(in, in_place); };
  const at::Tensor y = keep ? amp::recompute(*keep, block, x) : block(x);
  probe->up->weight.data().add_(1.0);
  y.pow(2).sum().backward();
  return probe->down->weight.grad().clone();
}

TEST(SelectiveRecompute, TheRerunTakesTheKeptOutputsInsteadOfComputingThem) {
  const at::Tensor plain = down_gradient_after_a_hidden_change(std::nullopt, false);
  // Kept: forward's up output reaches down's gradient, bit for bit.
  EXPECT_TRUE(BitEqual(down_gradient_after_a_hidden_change(amp::Keep::gemm_outputs(), false), plain));
  EXPECT_TRUE(BitEqual(down_gradient_after_a_hidden_change(amp::Keep::ops({"aten::addmm"}), false), plain));
  // Not kept: the rerun computes up's output again, from the changed weight.
  EXPECT_FALSE(at::allclose(down_gradient_after_a_hidden_change(amp::Keep::nothing(), false), plain));
  EXPECT_FALSE(at::allclose(
      down_gradient_after_a_hidden_change(amp::Keep::when({"aten::addmm"}, [](const Keep::Call&) { return false; }), false),
      plain));
  // Changed in place after its op returned: not kept, computed again.
  const at::Tensor plain_in_place = down_gradient_after_a_hidden_change(std::nullopt, true);
  EXPECT_FALSE(at::allclose(down_gradient_after_a_hidden_change(amp::Keep::gemm_outputs(), true), plain_in_place));
}

// Without the hidden change, a kept output changed in place leaves the
// gradients those of the plain block, bit for bit.
TEST(SelectiveRecompute, AnOutputChangedInPlaceIsComputedAgainBitForBit) {
  auto gradients = [](bool recompute) {
    torch::manual_seed(0);
    Probe probe;
    const at::Tensor x = torch::randn({4, 8}).requires_grad_();
    auto block = [probe](const at::Tensor& in) mutable { return probe->forward(in, /*in_place=*/true); };
    const at::Tensor y = recompute ? amp::recompute(amp::Keep::gemm_outputs(), block, x) : block(x);
    y.pow(2).sum().backward();
    std::vector<at::Tensor> grads{x.grad()};
    for (const auto& p : probe->parameters()) grads.push_back(p.grad());
    return grads;
  };
  expect_bit_equal(gradients(false), gradients(true), "gradient");
}

TEST(SelectiveRecompute, KeepRefusesWhatItCannotKeepAndSaysWhatToName) {
  EXPECT_AMP_ERROR(amp::Keep::ops({"aten::linear"}), "is composite");
  EXPECT_AMP_ERROR(amp::Keep::ops({"aten::matmul"}), "aten::addmm or aten::mm");
  EXPECT_AMP_ERROR(amp::Keep::ops({"aten::relu_"}), "in place");
  EXPECT_AMP_ERROR(amp::Keep::ops({"aten::transpose.int"}), "returns a view");
  EXPECT_AMP_ERROR(amp::Keep::ops({"aten::native_dropout"}), "draws random numbers");
  EXPECT_AMP_ERROR(amp::Keep::ops({"aten::no_such_op"}), "is not an ATen op");
  EXPECT_AMP_ERROR(amp::Keep::ops({"mm"}), "as \"aten::mm\"");
  EXPECT_AMP_ERROR(amp::Keep::ops({}), "at least one op");
  EXPECT_AMP_ERROR(amp::Keep::when({"aten::mm"}, nullptr), "predicate is empty");
  // Named twice (the kernel is registered once): still keepable.
  EXPECT_NO_THROW(amp::Keep::ops({"aten::mm", "aten::mm"}));
  EXPECT_NO_THROW(amp::Keep::gemm_outputs());
}

TEST(SelectiveRecompute, ARerunWhoseKeptCallsDifferFromForwardsIsRefused) {
  torch::manual_seed(0);
  torch::nn::Linear layer(8, 8);
  const at::Tensor x = torch::randn({4, 8}).requires_grad_();
  int runs = 0;
  auto block = [layer, &runs](const at::Tensor& in) mutable {
    at::Tensor h = layer(in);
    if (++runs > 1) h = layer(h);  // the rerun calls addmm once more
    return h;
  };
  const at::Tensor y = amp::recompute(amp::Keep::gemm_outputs(), block, x);
  EXPECT_AMP_ERROR(y.sum().backward(), "called aten::addmm where forward called nothing more");
}

// Keeping the GEMMs' outputs of a residual MLP: forward holds them (more
// than whole recomputation's inputs alone, less than no recomputation's
// activations); backward's rerun computes only the rest.
TEST_F(AmpTest, KeptGemmOutputsHoldBytesBetweenWholeRecomputationAndNone) {
  amp::track_allocations();
  auto held_after_forward = [](std::optional<amp::Keep> keep) {
    torch::manual_seed(0);
    torch::nn::ModuleList blocks;
    for (int i = 0; i < 4; ++i) blocks->push_back(Block(64));
    const at::Tensor x = torch::randn({1024, 64});
    CountedStep step(blocks);
    at::Tensor h = x;
    for (size_t i = 0; i < blocks->size(); ++i) {
      const auto b = blocks->ptr<BlockImpl>(i);
      auto run = [b](const at::Tensor& in) { return b->forward(in, false); };
      h = keep ? amp::recompute(*keep, run, h) : run(h);
    }
    return step.held();
  };
  const int64_t plain = held_after_forward(std::nullopt), whole = held_after_forward(amp::Keep::nothing()),
                gemms = held_after_forward(amp::Keep::gemm_outputs());
  std::printf("bytes held after forward: %lld none recomputed, %lld whole blocks, %lld keeping GEMM outputs\n",
              static_cast<long long>(plain), static_cast<long long>(whole), static_cast<long long>(gemms));
  // Each block keeps its two GEMMs' outputs: 1024 x 128 and 1024 x 64 bfloat16 values.
  EXPECT_EQ(gemms - whole, 4 * (1024 * 128 + 1024 * 64) * 2);
  EXPECT_LT(gemms, plain);
}

}  // namespace
}  // namespace amp::testing
