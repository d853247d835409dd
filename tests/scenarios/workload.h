// SPDX-License-Identifier: BSD-3-Clause
// What a program trains on, built the same way for amp and for the float64
// oracle: its models, its optimizers, its batches, and each loss's forward.
#pragma once

#include "program.h"

#include <amp/selective_recompute.h>

#include <torch/torch.h>

#include <memory>
#include <vector>

namespace amp::scenarios {

// One model of a program: [batch, kWidth] (or [batch, kTokens] token ids)
// to [batch, kWidth], through its blocks; Linear and Conv blocks end in tanh.
class ScenarioModelImpl : public torch::nn::Module {
 public:
  explicit ScenarioModelImpl(const ModelSpec& spec);
  at::Tensor forward(at::Tensor x);

 private:
  at::Tensor run_blocks(size_t begin, size_t end, at::Tensor x);
  // A kTableView block's read of the table through a view (program.h).
  at::Tensor read_table(const at::Tensor& x);
  // Blocks [begin, end) under amp::recompute, their second half again when `nested`.
  at::Tensor recompute_blocks(size_t begin, size_t end, bool nested, const at::Tensor& x);
  static amp::Keep keep_of(Kept kept);

  ModelSpec spec_;
  torch::nn::Embedding embedding_{nullptr};
  std::vector<std::shared_ptr<torch::nn::Module>> blocks_;  // null for kTableView
  at::Tensor table_;  // [kWidth, kWidth], with a kTableView block
};
TORCH_MODULE(ScenarioModel);

struct Workload {
  std::vector<ScenarioModel> models;
  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers;

  std::vector<std::shared_ptr<torch::nn::Module>> modules() const;
};

// Models initialized from `init_seed`, in `dtype`, and their optimizers.
// `fused`: amp's fused optimizer classes instead of LibTorch's own.
Workload build_workload(const Program& program, torch::Dtype dtype, uint64_t init_seed, bool fused = false);

// The data of one micro-batch of one loss: the same values for every run of
// the program (float32; the oracle widens them).
struct Batch {
  at::Tensor input;    // [kBatch, kWidth] features or [kBatch, kTokens] token ids
  at::Tensor target;   // [kBatch, kWidth]
  at::Tensor classes;  // [kBatch] class ids
};
Batch batch_for(const Program& program, int iteration, int phase, int loss, int micro_batch);

// The loss's value: its chain of models on the batch, then its loss function.
// Features are converted to `dtype` first.
at::Tensor loss_forward(const Workload& workload, const LossSpec& loss, const Batch& batch, torch::Dtype dtype);

// Zeroes the gradients of what `phase` steps, the way the program says:
// through the optimizers, through their models, or not at all.
void zero_gradients(const Program& program, const Phase& phase, const std::vector<ScenarioModel>& models,
                    const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers);

// The model whose parameters a loss's gradient penalty covers: the first one
// its gradients reach.
int penalty_model(const LossSpec& loss);

// Every parameter the optimizers step, optimizer by optimizer, as float64.
std::vector<at::Tensor> stepped_values(const std::vector<std::vector<at::Tensor>>& params_per_optimizer);

}  // namespace amp::scenarios
