// Data-parallel training with amp over LibTorch's c10d process groups.
//
// Built in: give amp the ranks' process group, and the single-process loop
// trains data-parallel as written - no gradient all-reduce of your own:
//
//   amp::Options options = amp::O2;
//   options.data_parallel.group = process_group;   // ProcessGroupGloo, ProcessGroupNCCL, ...
//   amp::initialize(model, optimizer, options);
//   ...
//   optimizer.zero_grad();
//   auto loss = loss_fn(model->forward(my_part_of_the_batch), ...);
//   {
//     amp::scale_loss scaled(loss, optimizer);
//     scaled.backward();    // buckets are all-reduced while backward runs
//   }                       // the guard installs the average, then unscales
//   optimizer.step();
//
// What amp does:
//   - initialize broadcasts rank 0's parameters and buffers, so every rank
//     starts from the same replica (a collective: every rank calls it).
//   - Each guard (delay_unscale=false) averages over the ranks the
//     gradients its backward produced for its optimizers' parameters. They
//     travel in buckets of about `bucket_bytes`, in reverse parameter order
//     (the order backward produces them): a hook on each parameter's
//     gradient accumulator copies its gradient into the bucket, and a full
//     bucket's all-reduce starts at once, overlapping the rest of backward.
//     Buckets start in the same order on every rank. The guard, when it
//     ends (or at unscale()), waits, installs the average as .grad and
//     unscales and checks it.
//   - The overflow verdict is taken from the averaged gradients, which are
//     the same bytes on every rank, so every rank skips the same steps and
//     keeps the same scale without another collective.
//   - Gradient accumulation: guards with delay_unscale=true reduce nothing
//     (DDP's no_sync); the last micro-batch's guard averages the whole sum.
//   - A parameter without a gradient on every rank keeps none; one with a
//     gradient on some ranks gets the average, the others counting zero
//     (finding that out reads the bucket on the host, only on a rank where
//     a parameter had no gradient).
// Inside a guard, after backward(), gradients are this rank's own; clip
// after unscale() (which averages first) or after the guard. Every rank must
// run the same guards in the same order, as with any collective; an
// exception in one rank's backward leaves the others waiting in theirs
// until the process group's timeout.
//
// Sharded (data_parallel.shard = true, O2/O5/O6; ZeRO stage 2): each rank
// keeps 1/N of what O2 keeps beside the low-precision weights - the float32
// masters, the optimizer's state, and the gradients - with the same loop.
// O6 has no masters: its pieces are the bfloat16 weights themselves (with
// BatchNorm's float32 ones), stepped by amp's fused optimizers with
// stochastic rounding, each rank drawing its own stream; its state in
// optimizer_state_dtype:
//   - The model holds its low-precision weights (BatchNorm float32) for
//     good. Each bucket is padded to a multiple of N and rank r owns its
//     r-th chunk: the optimizer's param groups hold this rank's float32
//     pieces (1-D; possibly none; O6: bfloat16), so its own state is 1/N.
//     amp::master_params returns them.
//   - Backward's gradients are reduce-scattered bucket by bucket while
//     backward runs and released; the guard installs each piece's average
//     as its .grad (in the piece's dtype), unscales it and agrees the
//     overflow across ranks. Over Gloo, whose reduce-scatter all-reduces
//     the whole bucket and keeps a chunk, amp all-reduces it itself and
//     reads the overflow (float32 pieces) and which parameters had
//     gradients from the whole sums: two collectives a step fewer, the same
//     bytes; buckets ready together (BatchNorm's float32 beside bfloat16)
//     go in one all-reduce, as small neighbouring buckets share one
//     all-gather.
//     Every guard reduces, delay_unscale ones too: the pieces accumulate
//     (shard_gradients=false: the last micro-batch's guard reduces the whole
//     sum, as without shard).
//   - step() updates the pieces, and the weights are all-gathered from them:
//     amp's fused optimizers (FusedAdam, FusedAdamW, FusedSGD) do it at the
//     end of their step, on every rank, so a forward on one rank alone
//     (evaluation, sampling, torch::save on rank 0) needs no collective.
//     After LibTorch's own optimizers it runs in the next forward, bucket by
//     bucket in forward order, each intercepted op waiting only for its own
//     bucket while the next ones travel (prefetch): every rank must run that
//     forward (evaluation under no_grad too); a rank that waits longer than
//     gather_timeout for the others there gets an error, not a hang. Until
//     then the model's weights are the ones before the step, and an op
//     outside amp's tables that reads a weight directly (x + pos_embedding)
//     before any intercepted op over its bucket reads those.
//   - Clip with amp::clip_grad_norm(optimizer, max_norm) (optimizer.h):
//     the norm spans every shard. LibTorch's clip_grad_norm_ over
//     model->parameters() sees no gradients (the pieces hold them).
//   - Checkpoints: amp::save_checkpoint and amp::save_fp32_weights gather the
//     whole masters and state (every rank calls them; rank 0 writes, as with
//     any data_parallel group) in the layout one process writes, so
//     amp::load_checkpoint loads them at any world size, sharded or not,
//     and training goes on bit for bit. torch::save(optimizer) writes only
//     this rank's pieces. A torch::load of the model's weights (float32 or
//     not) is taken into the pieces.
//   - amp::training_bytes(optimizer) measures what this rank holds.
//   - deinitialize (a collective) gives the model its float32 masters and,
//     while every rank's optimizer exists, the optimizer its parameters and
//     whole state.
// With LibTorch's elementwise optimizers the masters follow the replicated
// run bit for bit (reduce-scatter sums as all-reduce does; amp's fused ones
// within an ulp: ATen's CPU kernels round a tensor's vectorized body and
// its tail apart, and pieces end where tensors do not); accumulation with
// shard_gradients sums the micro-batches' averages instead of averaging
// their sum (float32 rounding), without it is bit for bit too.
//
// Without `group`, one process, as before; overflow_all_reduce (below) serves
// loops that all-reduce gradients themselves.
//
// Errors (c10::Error, at initialize, nothing changed): both
// data_parallel.group and reduce_overflow set; reduce_dtype not float32,
// float16 or bfloat16; bucket_bytes < 1; gather_timeout < 1 ms; sparse
// gradients (Embedding with sparse=true) with a group. With shard: no group;
// a level that steps the model's own weights (not O2, O5 or O6 with
// stochastic rounding); no optimizer; an optimizer other than SGD, Adam,
// AdamW, Adagrad, RMSprop (or amp's fused ones); a parameter in two groups
// or optimizers; an optimizer that already holds state (load it after
// initialize with amp::load_checkpoint). At a guard's opening (shard): a
// model parameter with a gradient (a backward outside scale_loss). At the
// guard's end: a parameter whose gradient was accumulated twice in one
// guard (two backward passes through it; run them in separate guards, or
// with delay_unscale); a sparse gradient; the process group's own errors. A
// data-parallel guard inside a CUDA graph capture (scale_loss.h). At an op
// of a forward (shard, after LibTorch's own step): the other ranks did not
// join the weights' all-gather within gather_timeout (the gather stays
// started; the next op over the weights waits for it again).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstdint>
#include <functional>

namespace amp {

struct DataParallel {
  // The ranks' c10d backend (ProcessGroupGloo, ProcessGroupNCCL; for a
  // c10d::ProcessGroup pass group->getDefaultBackend()). Null: one process.
  c10::intrusive_ptr<c10d::Backend> group;
  // The dtype gradients travel in: float32, or float16/bfloat16 for half
  // the bytes (each rank's gradient is divided by the world size before the
  // sum then, so the sum stays in range).
  at::ScalarType reduce_dtype = at::kFloat;
  // Gradient bytes per bucket (in reduce_dtype); DDP's default.
  int64_t bucket_bytes = 25 * 1024 * 1024;
  // O2/O5: spread the float32 master weights, the optimizer state and the
  // gradients over the ranks; O6: its bfloat16 weights' steps, state and
  // gradients (ZeRO stage 2; see "Sharded" above).
  bool shard = false;
  // With shard, gradient accumulation (delay_unscale): true reduce-scatters
  // every micro-batch (ZeRO-2: no rank holds whole gradients); false keeps
  // each rank's whole float32 sum until the last micro-batch and reduces
  // once (ZeRO-1: 1/k of the traffic for k micro-batches, whole gradients
  // held in between).
  bool shard_gradients = true;
  // With shard and LibTorch's own optimizers, the weights a step changed are
  // all-gathered in the next forward, which every rank must run: a rank that
  // waits this long for the others there stops with an error saying so (a
  // forward on one rank alone) instead of hanging. Bounds the host's waits
  // (CPU tensors); on a CUDA device the wait is the stream's. amp's fused
  // optimizers gather at the end of their step and never wait in a forward.
  std::chrono::milliseconds gather_timeout{std::chrono::seconds(60)};
};

// What this rank holds for `optimizer` (passed to amp::initialize), in
// bytes, measured from the tensors themselves (each storage once): what the
// optimizer steps (O2's float32 masters, or with shard this rank's pieces),
// its state, and the gradients of those and of the model's parameters;
// `weights`: the low-precision copies forward computes with where the
// optimizer steps something else (O2/O5's beside their masters, the
// gathered weights under shard; 0 where it steps them itself: O0, O1, O3,
// O6). `parameters` counts the elements of the whole parameters it trains,
// for bytes per parameter. Errors: amp is not initialized; an optimizer not
// passed to it.
struct TrainingBytes {
  int64_t weights = 0;
  int64_t masters = 0;
  int64_t optimizer_state = 0;
  int64_t gradients = 0;
  int64_t parameters = 0;
};
TrainingBytes training_bytes(const torch::optim::Optimizer& optimizer);

// For loops that all-reduce gradients themselves: combines every rank's
// overflow flag (MAX) before the scale update, so all ranks skip together.
//
//   options.reduce_overflow = amp::overflow_all_reduce(process_group);
//
// Where to reduce gradients then: after the guard and before step()
// (unscaled; at O2 the fp32 master gradients), or inside the guard after
// backward() (the scaled gradients, as DDP's hooks do). Errors: a null
// process group.
std::function<void(at::Tensor&)> overflow_all_reduce(c10::intrusive_ptr<c10d::Backend> group);

}  // namespace amp
