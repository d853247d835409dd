// SPDX-License-Identifier: BSD-3-Clause
#include "distributed/data_parallel_step.h"

#include "step/guard.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <utility>
#include <vector>

namespace amp::detail {

// One guard's averaging, started when it opened and finished before it
// unscales.
class DataParallelParticipant::Part final : public GuardPart {
 public:
  Part(DataParallelParticipant& owner, std::unique_ptr<GradientReducer::Reduction> reduction)
      : owner_(owner), reduction_(std::move(reduction)) {}

  void before_unscale(Guard&) override {
    if (!reduction_) return;
    reduction_->finish();
    agreed_ = reduction_->agreed_non_finite();
    reduction_.reset();
  }

  void agree_overflow(Guard&, at::Tensor& found_inf) override {
    if (agreed_.defined()) {
      found_inf.copy_(at::maximum(found_inf, agreed_));  // this rank's pieces are a part of the sums
    } else if (owner_.reduce_overflow_) {
      owner_.reduce_overflow_(found_inf);
    }
  }

  // ZeRO-1 (shard_gradients=false) keeps each rank's whole sum until the
  // accumulation's last guard; ZeRO-2's pieces already hold the averages.
  void prepare(Guard& guard) override {
    ShardedMasters* sharded = owner_.sharded_;
    if (sharded == nullptr || !guard.options().delay_unscale || owner_.reducer_->config().shard_gradients) return;
    for (OptimizerStep* step : guard.steps()) {
      sums_.push_back(sharded->of(step->optimizer())->sums_with_micro_batch(step->held()));
      step->reserve_sums(sums_.back().size());
    }
  }

  // The optimizers committed first: their records hold nothing of this
  // guard's then, and take ZeRO-1's new sums here.
  void commit(Guard& guard) noexcept override {
    ShardedMasters* sharded = owner_.sharded_;
    if (sharded == nullptr) return;
    for (size_t i = 0; i < guard.steps().size(); ++i) {
      OptimizerStep& step = *guard.steps()[i];
      if (!sums_.empty()) {
        for (auto& [member, sum] : sums_[i]) step.hold_sum(member, std::move(sum));
      } else if (!guard.options().delay_unscale) {
        sharded->of(step.optimizer())->mark_stale();
      }
    }
    sharded->clear_member_gradients();
    if (!guard.graph_retained()) sharded->free_weights();  // shard_weights: the round's weights go
  }

  void unwind(Guard& guard) noexcept override {
    reduction_.reset();
    if (owner_.sharded_ == nullptr) return;
    owner_.sharded_->clear_member_gradients();
    if (!guard.graph_retained()) owner_.sharded_->free_weights();
  }

 private:
  DataParallelParticipant& owner_;
  std::unique_ptr<GradientReducer::Reduction> reduction_;
  at::Tensor agreed_;  // the ranks' overflow, known from the sums without a collective
  std::vector<ShardedOptimizer::Sums> sums_;  // prepared: ZeRO-1's sums, per optimizer of the guard
};

DataParallelParticipant::DataParallelParticipant(GradientReducer* reducer, ShardedMasters* sharded,
                                   std::function<void(at::Tensor&)> reduce_overflow)
    : reducer_(reducer), sharded_(sharded), reduce_overflow_(std::move(reduce_overflow)) {}

void DataParallelParticipant::check_open(const Guard& guard) const {
  TORCH_CHECK(!(reducer_ && guard.capturing() && !guard.passthrough()), "amp: this scale_loss guard is "
              "being captured in a CUDA graph, but with Options::data_parallel its gradients are "
              "averaged by hooks and collectives the host drives; capture without data_parallel.");
}

std::unique_ptr<GuardPart> DataParallelParticipant::open(Guard& guard) {
  std::unique_ptr<GradientReducer::Reduction> reduction;
  if (sharded_ != nullptr) {
    // ZeRO-2 reduces in every guard, delay_unscale too: the pieces
    // accumulate the averages, so no rank keeps whole gradients between
    // micro-batches. ZeRO-1 reduces in the accumulation's last guard.
    if (!guard.options().delay_unscale || reducer_->config().shard_gradients) {
      std::vector<GradientReducer::ShardedOwner> owners;
      for (OptimizerStep* step : guard.steps()) owners.push_back({&sharded_->of(step->optimizer())->buckets(), &step->held()});
      GradientReducer::PiecesFinal pieces_final;
      if (guard.session().properties().step_in_backward) {
        pieces_final = [&guard](const std::vector<at::Tensor>& pieces) { guard.gradients_final(pieces); };
      }
      reduction = reducer_->start_sharded(owners, std::move(pieces_final));
    }
  } else if (reducer_ != nullptr && !guard.options().delay_unscale) {
    reduction = reducer_->start(guard.slots());  // delay_unscale: DDP's no_sync, the last guard reduces
  }
  return std::make_unique<Part>(*this, std::move(reduction));
}

void DataParallelParticipant::after_fused_step(const torch::optim::Optimizer& optimizer) {
  if (sharded_ != nullptr) sharded_->gather_after_step(optimizer);
}

void DataParallelParticipant::total_over_ranks(const torch::optim::Optimizer&, at::Tensor& sum_of_squares) {
  if (sharded_ == nullptr) return;  // replicas hold the same (averaged) gradients
  std::vector<at::Tensor> tensors{sum_of_squares};
  sharded_->group()->allreduce(tensors)->wait();
}

}  // namespace amp::detail
