// SPDX-License-Identifier: BSD-3-Clause
// Private: sharded masters and optimizer state (DataParallel::shard, ZeRO
// stage 2, or 1 with shard_gradients=false), one ShardedOptimizer per
// optimizer passed to initialize.
//
// Layout. The optimizer's parameters (the members) are grouped into buckets
// (gradient_reducer.h) of one dtype each - the dtype the model computes in:
// the low dtype, or float32 for BatchNorm - and each bucket is padded to a
// multiple of the world size. Rank r owns the r-th chunk of every bucket
// (Megatron's distributed optimizer): each member meets it in at most one
// interval, its piece. A rank's pieces may be none (an empty shard).
//
// Residences.
//   member (the module's parameter)   the compute dtype, for good: the
//                                     gathered weights forward reads
//   piece (1-D)                       the optimizer's parameter in its param
//                                     groups, so its state is 1/N: the
//                                     float32 master (O2, O5), or without
//                                     masters (O6) the compute dtype, which
//                                     the fused optimizers step with
//                                     stochastic rounding
//   gradients                         backward's scratch on the members,
//                                     released bucket by bucket as the
//                                     bucket is reduce-scattered; the pieces'
//                                     average after the guard
//
// After a guard ends, the optimizer steps the pieces; the members are stale
// until the next gather (all-gathers of the pieces in the compute dtypes,
// one per bucket, or one for neighbouring small buckets together up to
// bucket_bytes). amp's fused optimizers gather at the end of their step, on
// every rank, so a forward needs no collective (a forward on rank 0 alone
// works). After LibTorch's own step the gather runs in the next forward,
// bucket by bucket in forward order: the first intercepted op over a member
// starts it, each op waits only for its own bucket (and the ones before it),
// and the next kAhead buckets travel while the op computes (prefetch, as
// DeepSpeed and FSDP do). The next guard and checkpoints finish it. Before
// a forward starts it the ranks meet through the group's store
// (gather_rendezvous.h): a rank that waits longer than gather_wait() for the
// others there (a forward the other ranks never run) gets an error, and
// nothing was started, so the group goes on working; without a store the
// same wait bounds the collective itself. A write to a member behind amp's
// back (torch::load, an edit) is taken into the pieces before a gather
// starts.
//
// With shard_weights (ZeRO-3) the members hold bytes only while a run reads
// them (weight_residency.h): the first intercepted op over a member gathers
// its gather's buckets into freshly allocated members and starts the next
// kAhead in forward order; a recomputed block's rerun starts the gathers its
// forward read, and the previous block's, before it runs. Nothing is
// gathered after a step: every forward gathers from the pieces. The ranks
// meet before a round's first gather (the first after everything was
// freed), as above.
//
// Every function here that communicates is a collective: every rank calls
// it, in the same order.
#pragma once

#include "distributed/gather_rendezvous.h"
#include "distributed/gradient_reducer.h"
#include "distributed/weight_residency.h"
#include "model/model_weights.h"
#include "optim/held_gradients.h"

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <chrono>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

namespace amp::detail {

// The dtypes of the sharded tensors.
struct ShardDtypes {
  // Each parameter's dtype while training (the model's, gathered).
  std::function<at::ScalarType(const at::Tensor&)> compute;
  // The pieces are float32 masters; false: they are the compute dtype.
  bool masters = true;
  // Without masters: the optimizer state's dtype of bfloat16 pieces
  // (Properties::optimizer_state_dtype); other pieces' is their own.
  at::ScalarType rounded_state = at::kFloat;
};

class ShardedOptimizer {
 public:
  // Takes over `optimizer`'s parameters, whose float32 values are the
  // masters (call before lowering them): its param groups then hold this
  // rank's pieces. `name`: the same on every rank, and unique to this
  // optimizer of this initialization (its rendezvous keys).
  ShardedOptimizer(torch::optim::Optimizer& optimizer, const DataParallel& config, const ShardDtypes& dtypes,
                   const std::string& name);

  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  std::vector<ReduceBucket>& buckets() { return buckets_; }
  const std::vector<at::Tensor>& members() const { return members_; }
  bool owns(const at::Tensor& t) const { return index_.count(t.unsafeGetTensorImpl()) != 0; }

  // Records the members as the model holds them now (after lowering, after
  // a gather): later changes are writes behind amp's back.
  void record_members();
  // The optimizer may have stepped the pieces (a guard over it ended).
  void mark_stale() { stale_ = true; }
  // Some member awaits its bucket's gather (shard_weights: some member is freed).
  bool stale() const { return stage3_ ? !residency_.all_whole() : stale_; }
  bool shards_weights() const { return stage3_; }
  // Takes writes to members behind amp's back into the pieces.
  void take_member_writes();
  // After a guard: each member's gradient becomes a mark of no bytes, so
  // that model->zero_grad() (which resets the gradients it finds) is seen.
  void mark_member_gradients() noexcept;
  // Where model->zero_grad() reset a member's mark, the member's piece's
  // gradient is reset as optimizer.zero_grad() would, and the mark put back
  // (a guard's first act, before it checks the optimizers' gradients).
  void take_model_zeroing() noexcept;
  // At a guard's opening (after take_model_zeroing): errors if a member
  // carries a gradient other than its mark (a backward outside
  // scale_loss); then the marks are taken off.
  void check_member_gradients() const;
  void take_member_gradients() noexcept;
  // shard_gradients=false, a delay_unscale guard is ending: each member's
  // gradient added to its whole float32 sum that `held` (its optimizer's
  // record) keeps, as (member, new sum) - new tensors: nothing changes
  // until the record holds them.
  using Sums = std::vector<std::pair<at::Tensor, at::Tensor>>;
  Sums sums_with_micro_batch(const HeldGradients& held) const;
  // All-gathers the pieces into the members, every bucket (collective;
  // nothing when none is stale). A gather starting takes writes behind
  // amp's back into the pieces first.
  // `after_step`: at the end of amp's fused step, which every rank runs
  // (no meeting first).
  void gather(bool after_step = false) { gather_through(gathers_.size(), /*meet=*/!after_step); }
  // Gathers `member`'s bucket and those before it in forward order, and
  // starts the next kAhead (collective). Nothing for a tensor it does not own.
  void gather_for(const at::Tensor& member);
  // shard_weights: a recomputed block's run begins (its forward, or with
  // `rerun_of` its rerun, whose gathers start now; collective) and ends
  // (the members it gathered are freed).
  size_t begin_run(size_t rerun_of);
  void end_run() noexcept;
  // shard_weights: every member freed, gathers in flight awaited (the round
  // ends: after a guard, before deinitialize).
  void free_members() noexcept;
  // A member was set to `fp32` (torch::load, a checkpoint): its piece takes the values.
  void take_values(const at::Tensor& member, const at::Tensor& fp32);
  // Every member's float32 master (or piece values), whole (collective).
  std::vector<at::Tensor> full_masters();
  // The optimizer's archive as one unsharded process would write it (its
  // params the whole masters, their state whole; collective), and back
  // (each piece takes its slice; local): checkpoints that load at any
  // world size.
  void save(torch::serialize::OutputArchive& archive);
  void load(torch::serialize::InputArchive& archive);
  // Gives the members their float32 masters and, if every rank's optimizer
  // still exists, the optimizer its members with whole state (deinitialize;
  // collective).
  void restore();

 private:
  using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;
  // Every member's whole value of what `value` gives for its pieces
  // (float32; zeros where undefined), shaped as the member (collective).
  std::vector<at::Tensor> gather_whole(const std::function<at::Tensor(const ReduceBucket::Piece&)>& value);
  // The optimizer's state as one unsharded process would hold it, keyed by
  // `whole` (one float32 tensor per member) (collective).
  StateMap whole_state(const std::vector<at::Tensor>& whole);
  // Sets the param groups' parameters: the pieces, or one tensor per member.
  void set_group_params(const std::vector<at::Tensor>* per_member);
  const ReduceBucket::Piece* piece(size_t member) const;
  // The dtype of the state the optimizer keeps for `piece`.
  at::ScalarType state_dtype(const ReduceBucket::Piece& piece) const;
  bool optimizer_alive() const;
  // Records member `m` as the model holds it now.
  void record_member(size_t m);
  // Runs the first `count` gathers in forward order; `meet`: the ranks meet
  // first when this starts a round (errors: one waited too long).
  void gather_through(size_t count, bool meet);
  // The error of a rank that waited too long for the others at a gather.
  std::string lone_forward_error(const char* outcome) const;
  void launch(size_t gather);
  void take(size_t gather);
  // shard_weights: gather `g` whole for an op (collective), starting the
  // next kAhead in forward order outside a rerun.
  void gather_whole_for_op(size_t g);
  // shard_weights: the ranks meet before a round's first gather; a round
  // an evaluation (no grad) opened ends at the first op with gradients on.
  void open_round();
  void end_evaluation_round() noexcept;
  void free_gather(size_t g) noexcept;

  // Gathers started ahead of the one an op waits for: with it, their wholes
  // are the gather's extra memory.
  static constexpr size_t kAhead = 2;
  // One all-gather: buckets next to each other in forward order, together
  // about bucket_bytes (small ones of different dtypes - BatchNorm's float32
  // beside bfloat16 - travel together), as bytes: each bucket's chunk at
  // its offset in every rank's part.
  struct Gather {
    std::vector<size_t> buckets;
    std::vector<int64_t> offsets;  // bytes, in a rank's part (8-aligned)
    int64_t bytes = 0;             // a rank's part
  };
  struct InFlight {
    at::Tensor whole;
    c10::intrusive_ptr<c10d::Work> work;
  };

  torch::optim::Optimizer* optimizer_;
  c10::intrusive_ptr<c10d::Backend> group_;
  int rank_, world_;
  at::ScalarType rounded_state_;
  std::vector<at::Tensor> members_;                  // in param group order
  std::vector<std::vector<size_t>> group_members_;  // per param group
  std::vector<ReduceBucket> buckets_;
  std::vector<std::pair<size_t, size_t>> piece_of_;  // per member: (bucket, piece) or (npos, npos)
  std::vector<Gather> gathers_;        // forward order (the buckets are in reverse)
  std::vector<size_t> gather_of_;      // per member: its gather (npos: none)
  std::vector<InFlight> in_flight_;    // per gather
  size_t launched_ = 0, taken_ = 0;    // gathers started, and taken into the members
  std::chrono::milliseconds gather_timeout_;  // gather_wait()
  std::chrono::milliseconds group_timeout_;   // the group's own (0: none)
  GatherRendezvous rendezvous_;
  std::unordered_map<const c10::TensorImpl*, size_t> index_;
  std::vector<int64_t> versions_;
  std::vector<const void*> storages_;
  bool stale_ = false;
  bool warned_ = false;
  bool stage3_ = false;                // DataParallel::shard_weights
  std::vector<at::Tensor> marks_;      // per member: its gradient's mark (mark_member_gradients)
  WeightResidency residency_;
  bool round_open_ = false, round_without_grad_ = false;
};

// Every optimizer's sharding, as ModelWeights sees it.
class ShardedMasters final : public ShardedWeights {
 public:
  ShardedMasters(const std::vector<torch::optim::Optimizer*>& optimizers, const DataParallel& config,
                 const ShardDtypes& dtypes);
  ShardedOptimizer* of(const torch::optim::Optimizer& optimizer);
  const std::vector<std::unique_ptr<ShardedOptimizer>>& optimizers() const { return optimizers_; }
  const c10::intrusive_ptr<c10d::Backend>& group() const { return group_; }

  void record_members();
  bool stale() const override;
  bool owns(const at::Tensor& t) const override;
  void sync() override;
  void sync_for(const at::Tensor& t) override;
  // After `optimizer` stepped (amp's fused optimizers): gathers its weights
  // now, on every rank, so the next forward needs no collective.
  void gather_after_step(const torch::optim::Optimizer& optimizer);
  void take_member_gradients() override;
  void take_model_zeroing() noexcept override;
  size_t begin_block(size_t rerun_of) override;
  void end_block() noexcept override;
  // shard_weights: after a guard (its backward did not retain the graph):
  // every weight freed.
  void free_weights() noexcept;
  bool take_values(const at::Tensor& member, const at::Tensor& fp32) override;
  // Drops gradients backward left on members (losses through another
  // optimizer's parameters: scratch scaled by that loss) and marks them
  // (ShardedOptimizer::mark_member_gradients).
  void clear_member_gradients() noexcept;

 private:
  c10::intrusive_ptr<c10d::Backend> group_;
  bool shards_weights_;  // DataParallel::shard_weights
  std::vector<std::unique_ptr<ShardedOptimizer>> optimizers_;
};

}  // namespace amp::detail
