// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// DataParallel (Options::data_parallel): train data-parallel over a c10d
/// process group with the single-process loop as written - amp averages each
/// guard's gradients across the ranks while backward runs, and with `shard`
/// spreads O2/O5's float32 masters, the optimizer's state and the gradients
/// over the ranks (ZeRO-2), and with `shard_weights` the weights themselves
/// (ZeRO-3). How it works, what each rank holds, and the
/// rules of sharding: docs/guide.md, "Data-parallel training".
///
/// ```
///   amp::Options options = amp::O2;
///   options.data_parallel.group = process_group;   // ProcessGroupGloo, ProcessGroupNCCL, ...
///   options.data_parallel.shard = true;            // optional: ZeRO-2
///   options.data_parallel.shard_weights = true;    // optional, with shard: ZeRO-3
///   amp::initialize(model, optimizer, options);
/// ```
///
/// With shard, a parameter's gradient between guards is a mark of no bytes
/// (the gradients live in the shards: amp::master_params), so that
/// model->zero_grad() reaches the shards as optimizer.zero_grad() does.
///
/// Errors (c10::Error, at initialize, nothing changed): both
/// data_parallel.group and reduce_overflow set; reduce_dtype not float32,
/// float16 or bfloat16; bucket_bytes < 1; gather_timeout < 1 ms; sparse
/// gradients (Embedding with sparse=true) with a group; step_in_backward
/// with a group but without shard (replicated gradients are averaged after
/// backward; sharded, each rank steps its pieces as their bucket is
/// reduced). With shard: no group;
/// a level that steps the model's own weights (not O2, O5 or O6 with
/// stochastic rounding); no optimizer; an optimizer other than SGD, Adam,
/// AdamW, Adagrad, RMSprop (or amp's fused ones); a parameter in two groups
/// or optimizers; an optimizer that already holds state (load it after
/// initialize with amp::load_checkpoint). shard_weights without shard; with
/// a parameter that shares its storage with another tensor or does not
/// start it (it could not be freed alone). At a guard's opening (shard): a
/// model parameter with a gradient (a backward outside scale_loss). At the
/// guard's end: a parameter whose gradient was accumulated twice in one
/// guard (two backward passes through it; run them in separate guards, or
/// with delay_unscale); a sparse gradient; the process group's own errors. A
/// data-parallel guard inside a CUDA graph capture (scale_loss.h). At an op
/// of a forward (shard, after LibTorch's own step): the other ranks did not
/// come to the weights' all-gather within gather_timeout (or half the
/// group's own timeout, if shorter) - a forward on one rank alone (with
/// shard_weights every forward gathers). The ranks
/// meet through the group's store before the gather starts, so nothing was
/// started and the group goes on working; without a store amp can reach (a
/// ProcessGroupNCCL without `store` set) the gather stays started and the
/// next op over the weights waits for it again.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>

namespace amp {

/// Options::data_parallel: amp's data-parallel training over a c10d process
/// group (see data_parallel.h).
struct DataParallel {
  /// The ranks' c10d backend (ProcessGroupGloo, ProcessGroupNCCL; for a
  /// c10d::ProcessGroup pass group->getDefaultBackend()). Null: one process.
  /// amp holds it while initialized, and an initialization still live at exit
  /// is never ended (initialize.h). A program whose group carries CUDA tensors
  /// therefore calls amp::deinitialize() before main returns: the group then
  /// goes with main's own reference, and its worker threads end while the
  /// CUDA runtime is loaded (Python programs call destroy_process_group()).
  /// Left to exit, a Gloo worker thread can still touch CUDA as the runtime
  /// unloads and abort the process ("CUDA error: driver shutting down").
  c10::intrusive_ptr<c10d::Backend> group;
  /// The dtype gradients travel in: float32, or float16/bfloat16 for half
  /// the bytes (each rank's gradient is divided by the world size before the
  /// sum then, so the sum stays in range).
  at::ScalarType reduce_dtype = at::kFloat;
  /// Gradient bytes per bucket (in reduce_dtype); DDP's default.
  int64_t bucket_bytes = 25 * 1024 * 1024;
  /// O2/O5: spread the float32 master weights, the optimizer state and the
  /// gradients over the ranks; O6: its bfloat16 weights' steps, state and
  /// gradients (ZeRO stage 2; docs/guide.md, "Data-parallel training").
  bool shard = false;
  /// With shard: the weights themselves spread too (ZeRO stage 3). Each rank
  /// keeps only its pieces; a weight is all-gathered when an op first reads
  /// it and freed again when the run that read it ends - a block of
  /// amp::recompute (its forward, and again its rerun in backward, whose
  /// gathers start before it runs, the next block's behind it), or, read
  /// outside recomputed blocks, the scale_loss guard (with a guard whose
  /// backward kept the graph, the next guard that does not). Every forward,
  /// evaluation included, gathers: run it on every rank. Between uses a
  /// parameter holds no bytes, and an op amp does not intercept that reads
  /// one stops with ATen's error "data is not allocated" (read weights in
  /// forward; save and load with amp's checkpoints). docs/guide.md,
  /// "Data-parallel training".
  bool shard_weights = false;
  /// With shard, gradient accumulation (delay_unscale): true reduce-scatters
  /// every micro-batch (ZeRO-2: no rank holds whole gradients); false keeps
  /// each rank's whole float32 sum until the last micro-batch and reduces
  /// once (ZeRO-1: 1/k of the traffic for k micro-batches, whole gradients
  /// held in between).
  bool shard_gradients = true;
  /// With shard and LibTorch's own optimizers, the weights a step changed are
  /// all-gathered in the next forward, which every rank must run: a rank that
  /// waits this long for the others there stops with an error saying so (a
  /// forward on one rank alone) instead of hanging. Bounds the host's waits
  /// (CPU tensors); on a CUDA device the wait is the stream's. amp's fused
  /// optimizers gather at the end of their step and never wait in a forward.
  std::chrono::milliseconds gather_timeout{std::chrono::seconds(60)};
  /// With shard and LibTorch's own optimizers: the store the group was made
  /// from, where the ranks meet before a forward starts the gather (so a
  /// forward on one rank alone fails without leaving a collective in flight).
  /// Null: the store of a ProcessGroupGloo, found by amp; other backends
  /// (NCCL) keep theirs private, so pass it here.
  c10::intrusive_ptr<c10d::Store> store;
};

}  // namespace amp
