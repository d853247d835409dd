// SPDX-License-Identifier: BSD-3-Clause
#include "workload.h"

#include <amp/recompute.h>
#include <amp/selective_recompute.h>

#include <algorithm>

namespace amp::scenarios {

ScenarioModelImpl::ScenarioModelImpl(const ModelSpec& spec) : spec_(spec) {
  if (spec.token_input) embedding_ = register_module("embedding", torch::nn::Embedding(kVocabulary, kWidth));
  for (size_t i = 0; i < spec.blocks.size(); ++i) {
    const std::string name = "block" + std::to_string(i);
    // As in ResNets, no bias before a BatchNorm: it would cancel out, leaving
    // a gradient that is only rounding noise.
    const bool bias = i + 1 == spec.blocks.size() || spec.blocks[i + 1] != Block::kBatchNorm;
    switch (spec.blocks[i]) {
      case Block::kLinear:
        blocks_.push_back(register_module(name, torch::nn::Linear(torch::nn::LinearOptions(kWidth, kWidth).bias(bias))));
        break;
      case Block::kConv1d:  // [batch, 2, 4]
        blocks_.push_back(
            register_module(name, torch::nn::Conv1d(torch::nn::Conv1dOptions(2, 2, 3).padding(1).bias(bias))));
        break;
      case Block::kConv2d:  // [batch, 2, 2, 2]
        blocks_.push_back(
            register_module(name, torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 2, 3).padding(1).bias(bias))));
        break;
      case Block::kBatchNorm:
        blocks_.push_back(register_module(
            name, torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(kWidth).affine(spec.affine_norms))));
        break;
      case Block::kLayerNorm:
        blocks_.push_back(register_module(
            name, torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth}).elementwise_affine(spec.affine_norms))));
        break;
      case Block::kTableView:
        blocks_.push_back(nullptr);
        break;
    }
  }
  const bool reads_table = std::count(spec.blocks.begin(), spec.blocks.end(), Block::kTableView) > 0;
  if (reads_table && !(spec.token_input && spec.table_view == TableView::kTransposed)) {  // else: the tied Embedding's
    table_ = register_parameter("table", torch::randn({kWidth, kWidth}) * 0.3);
  }
}

at::Tensor ScenarioModelImpl::read_table(const at::Tensor& x) {
  switch (spec_.table_view) {
    case TableView::kPositionSlice:
      return table_.narrow(/*dim=*/0, /*start=*/0, /*length=*/x.size(0));
    case TableView::kTransposed: {
      const at::Tensor& tied = spec_.token_input ? embedding_->weight : table_;
      return x.matmul(tied.narrow(/*dim=*/0, /*start=*/0, /*length=*/kWidth).t());
    }
    case TableView::kHeads: {
      const std::vector<at::Tensor> heads = table_.chunk(2, /*dim=*/0);
      return torch::cat({x.matmul(heads[0].t()), x.matmul(heads[1].t())}, /*dim=*/1);
    }
  }
  return {};
}

at::Tensor ScenarioModelImpl::forward(at::Tensor x) {
  if (spec_.token_input) x = embedding_(x).mean(1);
  if (!spec_.recomputed) return run_blocks(0, blocks_.size(), x);
  const RecomputedBlocks& r = *spec_.recomputed;
  x = run_blocks(0, r.first, x);
  if (r.slices > 1) {
    x = amp::recompute_in_slices(r.slices, [this, r](const at::Tensor& in) { return run_blocks(r.first, r.last, in); },
                                 x, keep_of(r.keep));
  } else {
    x = recompute_blocks(r.first, r.last, r.nested, x);
  }
  return run_blocks(r.last, blocks_.size(), x);
}

amp::Keep ScenarioModelImpl::keep_of(Kept kept) {
  switch (kept) {
    case Kept::kGemmOutputs: return amp::Keep::gemm_outputs();
    case Kept::kSeveralOps:
      return amp::Keep::ops({"aten::addmm", "aten::mm", "aten::convolution", "aten::tanh", "aten::native_layer_norm"});
    case Kept::kNothing: break;
  }
  return amp::Keep::nothing();
}

at::Tensor ScenarioModelImpl::recompute_blocks(size_t begin, size_t end, bool nested, const at::Tensor& x) {
  return amp::recompute(keep_of(spec_.recomputed->keep), [this, begin, end, nested](const at::Tensor& in) {
    if (!nested) return run_blocks(begin, end, in);
    const size_t middle = (begin + end) / 2;
    return recompute_blocks(middle, end, /*nested=*/false, run_blocks(begin, middle, in));
  }, x);
}

at::Tensor ScenarioModelImpl::run_blocks(size_t begin, size_t end, at::Tensor x) {
  for (size_t i = begin; i < end; ++i) {
    auto* module = blocks_[i].get();
    switch (spec_.blocks[i]) {
      case Block::kLinear:
        x = torch::tanh(static_cast<torch::nn::LinearImpl*>(module)->forward(x));
        break;
      case Block::kConv1d:
        x = torch::tanh(static_cast<torch::nn::Conv1dImpl*>(module)->forward(x.reshape({-1, 2, 4})).reshape({-1, kWidth}));
        break;
      case Block::kConv2d:
        x = torch::tanh(
            static_cast<torch::nn::Conv2dImpl*>(module)->forward(x.reshape({-1, 2, 2, 2})).reshape({-1, kWidth}));
        break;
      case Block::kBatchNorm:
        x = static_cast<torch::nn::BatchNorm1dImpl*>(module)->forward(x);
        break;
      case Block::kLayerNorm:
        x = static_cast<torch::nn::LayerNormImpl*>(module)->forward(x);
        break;
      case Block::kTableView:
        x = x + torch::tanh(read_table(x));
        break;
    }
  }
  return x;
}

std::vector<std::shared_ptr<torch::nn::Module>> Workload::modules() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& m : models) out.push_back(m.ptr());
  return out;
}

namespace {

// Adam's update is lr * m / (sqrt(v) + eps): with a tiny eps, an element
// whose true gradient is near zero moves by a full lr in the direction of its
// rounding noise, in float64 as in bfloat16. An eps near the gradients' size
// keeps updates continuous in the gradient, so a tolerance can bound them.
constexpr double kAdamEps = 1e-2;

template <class Fused, class Own, class Options>
std::shared_ptr<torch::optim::Optimizer> make(bool fused, std::vector<at::Tensor> params, const Options& options) {
  if (fused) return std::make_shared<Fused>(std::move(params), options);
  return std::make_shared<Own>(std::move(params), options);
}

std::shared_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerSpec& spec, std::vector<at::Tensor> params,
                                                        bool fused) {
  using namespace torch::optim;
  switch (spec.kind) {
    case OptimizerKind::kSGD:
      return make<amp::optim::FusedSGD, SGD>(
          fused, params,
          SGDOptions(spec.lr).momentum(spec.momentum).nesterov(spec.nesterov).weight_decay(spec.weight_decay));
    case OptimizerKind::kAdam:
      return make<amp::optim::FusedAdam, Adam>(
          fused, params, AdamOptions(spec.lr).eps(kAdamEps).weight_decay(spec.weight_decay).amsgrad(spec.amsgrad));
    case OptimizerKind::kAdamW:
      return make<amp::optim::FusedAdamW, AdamW>(
          fused, params, AdamWOptions(spec.lr).eps(kAdamEps).weight_decay(spec.weight_decay).amsgrad(spec.amsgrad));
  }
  return nullptr;
}

}  // namespace

Workload build_workload(const Program& program, torch::Dtype dtype, uint64_t init_seed, bool fused) {
  Workload w;
  torch::manual_seed(init_seed);
  for (const ModelSpec& spec : program.models) {
    w.models.emplace_back(spec);
    w.models.back()->to(dtype);  // initialized in float32, then widened exactly
  }
  for (const OptimizerSpec& spec : program.optimizers) {
    std::vector<at::Tensor> params;
    for (int m : spec.models) {
      for (const auto& p : w.models[m]->parameters()) params.push_back(p);
    }
    w.optimizers.push_back(make_optimizer(spec, params, fused));
  }
  return w;
}

Batch batch_for(const Program& program, int iteration, int phase, int loss, int micro_batch) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(program.seed * 7919 + iteration * 1000 + phase * 100 +
                                                            loss * 10 + micro_batch);
  Batch b;
  const int first = program.phases[phase].losses[loss].chain.front();
  b.input = program.models[first].token_input
                ? at::randint(kVocabulary, {kBatch, kTokens}, generator, at::kLong)
                : at::randn({kBatch, kWidth}, generator, at::kFloat);
  b.target = at::randn({kBatch, kWidth}, generator, at::kFloat);
  b.classes = at::randint(kWidth, {kBatch}, generator, at::kLong);
  return b;
}

at::Tensor loss_forward(const Workload& workload, const LossSpec& loss, const Batch& batch, torch::Dtype dtype) {
  at::Tensor x = batch.input.is_floating_point() ? batch.input.to(dtype) : batch.input;
  for (size_t i = 0; i < loss.chain.size(); ++i) {
    x = workload.models[loss.chain[i]].ptr()->forward(x);
    if (static_cast<int>(i) == loss.detach_after) x = x.detach();
  }
  switch (loss.kind) {
    case LossKind::kMse:
      return torch::mse_loss(x, batch.target.to(dtype));
    case LossKind::kSoftplusMean:
      return torch::softplus(x).mean();
    case LossKind::kCrossEntropy:
      return torch::cross_entropy_loss(x, batch.classes);
  }
  return {};
}

void zero_gradients(const Program& program, const Phase& phase, const std::vector<ScenarioModel>& models,
                    const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers) {
  for (int o : phase.steps) {
    if (program.zero == Zero::kOptimizer) optimizers[o]->zero_grad();
    if (program.zero != Zero::kModel) continue;
    for (int m : program.optimizers[o].models) models[m].ptr()->zero_grad();
  }
}

int penalty_model(const LossSpec& loss) { return reached_models(loss).front(); }

std::vector<at::Tensor> stepped_values(const std::vector<std::vector<at::Tensor>>& params_per_optimizer) {
  std::vector<at::Tensor> out;
  for (const auto& params : params_per_optimizer) {
    for (const auto& p : params) out.push_back(p.detach().to(at::kDouble).clone());
  }
  return out;
}

}  // namespace amp::scenarios
