// SPDX-License-Identifier: BSD-3-Clause
// Private: data parallel as a step participant (step/step_participant.h).
// Each guard averages its gradients across ranks (GradientReducer): over
// whole gradients (replicated) or, with sharding, into each rank's pieces
// (ShardedMasters); the ranks agree on the overflow; with sharding, a
// guard's commit ends or holds the accumulation and marks the weights
// stale, and amp's fused optimizers gather the weights after their step.
// Also serves Options::reduce_overflow in one process group of the
// program's own.
#pragma once

#include "distributed/gradient_reducer.h"
#include "distributed/sharded_optimizer.h"
#include "step/step_participant.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace amp::detail {

class DataParallelParticipant final : public StepParticipant {
 public:
  // `reducer` and `sharded` may be null (no data_parallel, or no sharding);
  // `reduce_overflow` combines the ranks' overflow flags (MAX), or is empty.
  DataParallelParticipant(GradientReducer* reducer, ShardedMasters* sharded,
                   std::function<void(at::Tensor&)> reduce_overflow);

  void check_open(const Guard& guard) const override;
  std::unique_ptr<GuardPart> open(Guard& guard) override;
  void after_fused_step(const torch::optim::Optimizer& optimizer) override;
  void total_over_ranks(const torch::optim::Optimizer& optimizer, at::Tensor& sum_of_squares) override;

 private:
  class Part;
  GradientReducer* reducer_;
  ShardedMasters* sharded_;
  std::function<void(at::Tensor&)> reduce_overflow_;
};

}  // namespace amp::detail
