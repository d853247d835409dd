// SPDX-License-Identifier: BSD-3-Clause
// Private: data-parallel gradient averaging (Options::data_parallel), the
// bucketed reduction a scale_loss guard runs over its parameters.
//
// A bucket is one flat tensor in the reduce dtype that the gradients of its
// members fill, in reverse parameter order (the order backward produces
// them). Replicated (shard=false): the guard's parameters are the members,
// one "used" flag per member follows the gradients, and the bucket is
// all-reduced; layouts are kept per set of parameters, so a GAN's
// alternating guards reuse theirs. Sharded (shard=true,
// sharded_optimizer.h): the model's parameters are the members, the bucket
// is padded to a multiple of the world size and reduce-scattered (over
// Gloo all-reduced, with the members' flags, as Gloo's reduce-scatter does
// inside), and each rank keeps the chunk its optimizer's pieces cover.
//
// One guard's reduction (Reduction) hooks the members' gradient
// accumulators. When backward has produced every gradient of a bucket, the
// bucket is filled (sharded: the members' gradients are released then) and,
// if every earlier bucket has started, its collective starts - in bucket
// order, so the ranks' collectives match. Sharded, a bucket's full buffer
// (the whole bucket in the reduce dtype) goes as soon as its reduce-scatter
// is done; at most two wait at once, so no rank holds every gradient in
// float32 at the end of backward; the chunk is averaged then, in its
// pieces' dtype. finish()
// starts what backward left (members without a gradient count zero), waits,
// and installs the averages: new tensors as the parameters' .grad
// (replicated), or the chunks' views as the pieces' .grad (sharded).
#pragma once

#include "autograd/accumulator_hooks.h"
#include "optim/held_gradients.h"
#include "optim/unscale_plan.h"

#include <amp/distributed.h>

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace amp::detail {

struct ReduceBucket {
  // Sharded: one piece of a member this rank's optimizer steps.
  struct Piece {
    size_t member;          // index into the bucket's members
    int64_t begin = 0;      // first element, in the member flattened
    int64_t length = 0;
    int64_t chunk_offset = 0;  // where it starts in this rank's chunk
    at::Tensor stepped;     // 1-D: the tensor the optimizer steps (sharded_optimizer.h)
  };
  std::vector<at::Tensor> members;  // whose gradients fill it
  std::vector<size_t> ids;          // the members' indices in their owner's list
  std::vector<int64_t> offsets;     // of each member's gradient in `flat`
  int64_t numel = 0;                // gradient elements
  int64_t padded = 0;               // sharded: numel rounded up to a multiple of the world size
  at::ScalarType dtype = at::kFloat;  // sharded: the members' dtype (one per bucket)
  at::ScalarType stepped_dtype = at::kFloat;  // sharded: the pieces' (every rank's)
  std::vector<Piece> pieces;        // sharded: this rank's
  at::Tensor flat;                  // replicated: kept; sharded: only while reducing
  at::Tensor chunk;                 // sharded: this rank's reduced part, while reducing
  c10::intrusive_ptr<c10d::Work> work;  // started and not yet waited for
};

// Buckets of about `bucket_bytes` (at `element_size` bytes per element) over
// the members in reverse order. Members with key -1 stay out; a bucket holds
// members of one key.
std::vector<ReduceBucket> plan_buckets(const std::vector<at::Tensor>& members,
                                       const std::vector<int>& keys, int64_t bucket_bytes,
                                       int64_t element_size);

class GradientReducer {
 public:
  explicit GradientReducer(DataParallel config);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  const DataParallel& config() const { return config_; }

  class Reduction;
  // Replicated: starts one guard's reduction over `slots` (which must
  // outlive it): hooks the gradient accumulators backward will run. Waits
  // for reductions an unwound guard left running on the same buckets.
  std::unique_ptr<Reduction> start(std::vector<GradSlot>& slots);
  // Sharded: the same over the buckets of the guard's sharded optimizers,
  // in the guard's order, each with its optimizer's record
  // (optimizer_step.h), whose held float32 sums of an accumulation's earlier
  // micro-batches (ZeRO-1) are reduced with this backward's gradients.
  struct ShardedOwner {
    std::vector<ReduceBucket>* buckets;
    const HeldGradients* sums;
  };
  // Sharded, Properties::step_in_backward: as soon as a bucket that
  // backward filled whole is averaged, its pieces take their gradients
  // (views of the chunk) and are handed to `pieces_final`, which steps them
  // and drops those gradients; the chunk goes then, so no rank holds its
  // part of every gradient at the end of backward. Buckets finish() starts
  // (members backward did not reach) are installed as usual.
  using PiecesFinal = std::function<void(const std::vector<at::Tensor>& pieces)>;
  std::unique_ptr<Reduction> start_sharded(const std::vector<ShardedOwner>& owners, PiecesFinal pieces_final = {});

 private:
  struct Layout;
  DataParallel config_;
  int rank_, world_;
  std::map<std::vector<const void*>, std::unique_ptr<Layout>> layouts_;
};

class GradientReducer::Reduction {
 public:
  // `slots`: the guard's (replicated); null when sharded, where `sums` holds
  // each bucket's record of earlier sums.
  Reduction(GradientReducer& reducer, std::vector<ReduceBucket*> buckets, std::vector<GradSlot>* slots,
            std::vector<const HeldGradients*> sums = {}, PiecesFinal pieces_final = {});
  // Unhooks; reductions already started are waited for by the next start().
  ~Reduction();
  Reduction(const Reduction&) = delete;
  Reduction& operator=(const Reduction&) = delete;

  // Starts every remaining bucket, waits for all, and installs the averages.
  // Replicated slots with a scaled aside (an accumulation's earlier
  // micro-batches) have it reduced with their fresh gradient and marked
  // aside_reduced. Errors: see distributed.h.
  void finish();
  // Sharded over a backend whose reduce-scatter is an all-reduce (Gloo):
  // whether any averaged gradient of the guard is inf or NaN (a float32
  // tensor of one element), the same bytes on every rank, or undefined
  // where the ranks must agree it with a collective (another backend, or
  // pieces narrower than float32, whose rounding can overflow).
  const at::Tensor& agreed_non_finite() const { return agreed_non_finite_; }

 private:
  bool sharded() const { return slots_ == nullptr; }
  // Sharded: reduced by an all-reduce whose chunk is kept (see the .cpp).
  bool whole_sums() const { return whole_sums_; }
  // An accumulation's earlier micro-batches, scaled, reduced with this
  // backward's gradient of bucket `b`'s member `j` (undefined: none).
  at::Tensor earlier_sum(size_t b, size_t j) const;
  void on_gradient(size_t member);
  void fill(size_t bucket);
  void start_ready_buckets();
  void keep_chunk(size_t bucket);
  // Sharded: frees the full buffers of buckets whose reduce-scatter is done,
  // waiting for the oldest while more than `in_flight` hold theirs.
  void release_reduced(size_t in_flight);
  // Sharded, its reduce-scatter done: the chunk becomes the average, in
  // the dtype its pieces are stepped in (O6's bfloat16; float32 masters
  // reduced in a low dtype), before the next bucket's reduction.
  void average_chunk(ReduceBucket& bucket);
  void install_replicated();
  void install_sharded(const at::Tensor& used);
  // Sharded: bucket `b`'s pieces whose member `gets` (its index among the
  // guard's members) take their gradients, views of the averaged chunk;
  // the others none. The reduction lets the chunk go.
  void install_bucket(size_t b, const std::function<bool(size_t member)>& gets);
  // step_in_backward: bucket `b` was filled whole by backward and is
  // averaged - its pieces are stepped now (PiecesFinal).
  void hand_over(size_t b);

  GradientReducer& reducer_;
  std::vector<ReduceBucket*> buckets_;
  std::vector<GradSlot>* slots_;
  std::vector<const HeldGradients*> sums_;  // sharded: per bucket
  PiecesFinal pieces_final_;            // sharded, step_in_backward
  std::vector<bool> handed_over_;       // per bucket: its pieces were stepped in backward
  std::vector<size_t> first_member_;    // per bucket: its first member's index below
  std::vector<bool> produced_;          // per member (buckets in order): its accumulator ran
  std::vector<int64_t> missing_;        // per bucket: members not produced yet
  size_t next_bucket_ = 0;              // buckets before it have started
  size_t released_ = 0;                 // sharded: buckets before it hold only their chunk
  std::mutex mutex_;  // hooks run on autograd's threads
  AccumulatorHooks hooks_;
  std::string error_;                   // met inside a hook, raised by finish()
  bool whole_sums_ = false;
  std::vector<at::Tensor> used_;        // whole_sums: per bucket, its members' summed flags
  at::Tensor agreed_non_finite_;
};

}  // namespace amp::detail
