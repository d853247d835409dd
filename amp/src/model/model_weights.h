// SPDX-License-Identifier: BSD-3-Clause
// Private: the models' weights at the levels that lower them (O2, O3, O5).
//
// Masters (O2/O5 with optimizers). Each lowered parameter and buffer keeps
// one TensorImpl for good - the one the module, the program's optimizer and
// its state map hold - and amp moves its data between two residences:
//
//   resting    float32: the master weight. The program's optimizer steps it,
//              torch::save writes it, torch::load fills it, clipping reads
//              its float32 gradient. Between iterations, and under no_grad.
//   computing  the low dtype: a buffer amp fills from the master on
//              entering, for forward and backward, and frees on resting
//              (between iterations a model holds its masters alone).
//
//   event                               residence   gradient (.grad)
//   ----------------------------------  ----------  -----------------------------------
//   initialize, guard ends              resting     float32 (the step's), or none
//   first op that records a graph on    computing   unchanged: float32 or none, so
//     a master (grad mode): where it                zero_grad after forward still works
//     meets other tensors, or a view
//     or indexed read of it
//   guard opens                         computing   set aside by the guard; backward
//                                                   writes a low-precision scratch one
//   guard unscales (at its end, or      resting     float32: unscaled scratch + aside,
//     scale_loss::unscale())                        made after the copies are freed
//
// Entering refreshes every low-precision buffer from the float32 data the
// weight holds at that moment, so whatever changed it at rest (a step, a
// torch::load, a user edit) is what forward sees; reads under no_grad see
// that float32 data. Leaving copies back the buffers' values forward wrote
// (BatchNorm running statistics). A guard enters too, so a graph recorded
// before an earlier guard ended backpropagates through the dtypes it was
// recorded in. A graph recorded over a resting weight (by an op amp does
// not see, `w.pow(2).sum()` in grad mode) that is still alive when the
// weight enters would send float32 gradients to it beside the forward's:
// entering says so once (the warning "weight_read_in_float32").
//
// Writes behind amp's back while computing are found when a guard opens:
// a storage replaced by torch::load (LibTorch copies a float32 checkpoint's
// bytes into a float16 tensor without converting them) is read back as the
// float32 values it holds; an in-place write is taken into the master (from
// its low-precision value, with a warning), unless the weight carries a
// low-precision gradient - then a backward ran outside amp::scale_loss and
// the optimizer stepped on it: an error.
//
// Sharded (O2/O5 with Options::data_parallel.shard): converted weights, and
// the float32 masters in pieces across the ranks (ShardedWeights); the
// first intercepted op over a weight after a guard (a view or indexed read
// of it included) gathers them.
//
// Converted (O3, or O2/O5 without master weights): the weights are lowered
// for good. A torch::load of a float32 checkpoint into them (the same
// unconverted bytes) is found at the first intercepted op after
// initialize or a guard, and at every guard opening, and repaired from the
// float32 values the storage holds.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace amp::detail {

// Buffers by name ("layer1.bn.running_mean"; "model1.…" with several models).
using NamedBuffers = std::vector<std::pair<std::string, at::Tensor>>;

// A float32 tensor over the storage of a 16-bit tensor that holds float32
// bytes (LibTorch's InputArchive gives a tensor the storage of the tensor it
// read, keeping its own dtype: a float32 checkpoint read into a float16
// model); undefined when the bytes fit the tensor's own dtype.
at::Tensor foreign_float32_values(const at::Tensor& t);

// Options::data_parallel.shard (distributed/sharded_optimizer.h): the
// float32 masters live in pieces spread over the ranks; the models, in
// converted mode, hold the gathered weights.
class ShardedWeights {
 public:
  virtual ~ShardedWeights() = default;
  // A guard ended: the optimizers may have stepped, the weights await a gather.
  virtual bool stale() const = 0;
  virtual bool owns(const at::Tensor& t) const = 0;
  // Takes writes to the weights behind amp's back into the masters, then
  // gathers stale weights (a collective).
  virtual void sync() = 0;
  // Before an op over `t`: if it is a weight, gathers the weights up to its
  // (a collective; sharded_optimizer.h); nothing for other tensors.
  virtual void sync_for(const at::Tensor& t) = 0;
  // At a guard's opening, after take_model_zeroing: the weights' gradient
  // marks are taken off. Errors (nothing changed): a weight carries a
  // gradient (a backward outside scale_loss).
  virtual void take_member_gradients() = 0;
  // A guard's first act: the masters' gradients of weights model->zero_grad()
  // reached since the last guard are reset (as if it had reached them).
  virtual void take_model_zeroing() noexcept = 0;
  // shard_weights (ZeRO-3): a recomputed block's run begins - its forward
  // (kForward: returns the block's id) or the rerun of block `rerun_of`
  // (starts the gathers its forward read; a collective) - and ends, freeing
  // the weights it gathered. Other sharding: nothing.
  static constexpr size_t kForward = static_cast<size_t>(-1);
  virtual size_t begin_block(size_t rerun_of) = 0;
  virtual void end_block() noexcept = 0;

  // `member` was set to the values `fp32` (torch::load): its master takes
  // them. False for other tensors.
  virtual bool take_values(const at::Tensor& member, const at::Tensor& fp32) = 0;

  // ModelWeights' flag that makes the next intercepted op check the weights:
  // set whenever weights are freed (ZeRO-3).
  void watch_with(std::atomic<bool>* pending) { pending_ = pending; }

 protected:
  void weights_freed() const {
    if (pending_ != nullptr) pending_->store(true);
  }

 private:
  std::atomic<bool>* pending_ = nullptr;
};

class ModelWeights {
 public:
  enum class Mode { kNone, kMasters, kConverted };
  struct Entry {
    std::string name;         // "fc1.weight", "model1.bn.running_mean"
    at::Tensor tensor;        // the module's own parameter or buffer
    size_t model = 0;         // which of initialize's models it belongs to
    bool is_buffer = false;
    at::ScalarType low = at::kHalf;  // its dtype while computing (converted: always)
    at::Tensor rest;          // masters: the float32 data, while computing
    at::Tensor compute;       // masters: the low-precision buffer
    int64_t version = 0;      // tensor's version when it last entered computing
    const void* storage = nullptr;  // converted: the storage last seen
  };

  ModelWeights() = default;
  ModelWeights(Mode mode, std::vector<Entry> entries, size_t models);
  ModelWeights(const ModelWeights&) = delete;
  ModelWeights& operator=(const ModelWeights&) = delete;

  Mode mode() const { return mode_; }
  // Converted weights whose masters are sharded (set once, by the context).
  void set_sharded(ShardedWeights* sharded) {
    sharded_ = sharded;
    sharded->watch_with(&pending_);
    pending_.store(true);
  }
  ShardedWeights* sharded() const { return sharded_; }
  const std::vector<Entry>& entries() const { return entries_; }

  // Hot path: whether an intercepted op must call on_op() first (a model
  // rests, or converted weights await their check).
  bool pending() const { return pending_.load(std::memory_order_relaxed); }
  // Masters: a graph-recording op where a model's parameters or buffers
  // meet other tensors (forward: weights meet activations or indices), or
  // that reads them through a view or an index (`weight_read`,
  // weight_reads.h: a view's dtype is fixed when it is taken), enters that
  // model into computing, before the op saves anything for backward; other
  // ops over the model's tensors alone (a logged weight norm) read them in
  // float32. Converted: gathers sharded weights, checks the weights'
  // storages. Errors: as enter_compute.
  template <class Args>
  void on_op(const Args& args, bool weight_read = false);
  // Before a recomputed block's forward (recompute.h), with gradients on:
  // every model enters computing (masters) or has its weights gathered
  // (sharded), so the forward and backward's rerun of the block read the
  // weights alike whatever op reads them first. Errors: as enter_compute.
  void enter_forward();

  // A recomputed block's run (recompute.h) begins and ends: with sharded
  // weights (ZeRO-3) the weights it gathered are freed at its end
  // (ShardedWeights::begin_block). Returns the block's id.
  size_t begin_block(size_t rerun_of = ShardedWeights::kForward);
  void end_block() noexcept;

  // A guard's first act, before it checks the optimizers' gradients: a
  // model->zero_grad() of sharded weights reaches their masters
  // (ShardedWeights::take_model_zeroing).
  void take_model_zeroing() noexcept {
    if (mode_ == Mode::kConverted && sharded_ != nullptr) sharded_->take_model_zeroing();
  }

  // At a guard's opening: enters every model into computing (a graph
  // recorded before an earlier guard ended backpropagates in the dtypes it
  // was recorded in) and checks for writes behind amp's back (see above).
  // Errors (nothing changes): a master with a low-precision gradient, or
  // one that is no longer float32 at rest.
  void prepare_backward();
  // When a guard unscales (and at its end, and deinitialize). Masters:
  // every model back to rest, its low-precision copies freed.
  // Converted: the next intercepted op checks again.
  void finish_backward() noexcept;

  // torch::load's `self.set_(source)` into a lowered weight: takes the
  // source's values in the weight's dtype (a master's float32 data, and its
  // low-precision copy while computing) instead of reinterpreting its bytes.
  // Returns false, changing nothing, for other tensors.
  bool load_into(at::Tensor& self, const at::Tensor& source);

  // Whether `t` is one of the masters (O2's float32 weights at rest).
  bool is_master(const at::Tensor& t) const {
    return mode_ == Mode::kMasters && index_.count(t.unsafeGetTensorImpl()) != 0;
  }
  // The float32 value of a model tensor: a master's float32 data in either
  // residence; a low-precision tensor widened; others as they are.
  at::Tensor fp32_value(const at::Tensor& t) const;

 private:
  void enter_compute(const std::vector<bool>& models);
  void check_converted();
  void check_computing();
  void update_pending();
  const Entry* find(const at::Tensor& t) const { return find(t.unsafeGetTensorImpl()); }
  const Entry* find(const c10::TensorImpl* t) const;
  Entry* find(const at::Tensor& t) { return const_cast<Entry*>(std::as_const(*this).find(t)); }

  Mode mode_ = Mode::kNone;
  std::vector<Entry> entries_;
  std::unordered_map<const c10::TensorImpl*, size_t> index_;  // entries by TensorImpl
  std::mutex mutex_;
  std::vector<bool> resting_;  // per model
  std::atomic<bool> pending_{false};
  bool warned_ = false;
  bool warned_read_at_rest_ = false;
  ShardedWeights* sharded_ = nullptr;
};

template <class Args>
void ModelWeights::on_op(const Args& args, bool weight_read) {
  if (mode_ == Mode::kConverted) {
    if (sharded_ != nullptr) {  // gather at ops over the weights, the same ops on every rank
      args.for_each_tensor([&](const at::Tensor& t, bool) {
        if (!t.defined() || !sharded_->stale()) return;
        sharded_->sync_for(t.is_view() ? at::Tensor(t._base()) : t);  // weight.t() counts as the weight
      });
      if (sharded_->stale()) return;  // buckets still to gather: check again at the next op
      sharded_->sync();               // takes writes behind amp's back
    }
    check_converted();
    return;
  }
  if (!at::GradMode::is_enabled()) return;  // no graph: the op reads the float32 weights
  std::vector<bool> models;
  bool other = false;
  args.for_each_tensor([&](const at::Tensor& t, bool) {
    if (!t.defined()) return;
    // A view counts as the tensor it views: nn::Linear without a bias passes
    // weight.t() to mm, made before this op lowers the weight (the cast cache
    // then serves the view of the lowered weight).
    const Entry* e = find(t.is_view() ? t._base().unsafeGetTensorImpl() : t.unsafeGetTensorImpl());
    if (e == nullptr) {
      other = true;
      return;
    }
    if (models.empty()) models.resize(resting_.size());
    models[e->model] = true;
  });
  if ((other || weight_read) && !models.empty()) enter_compute(models);
}

}  // namespace amp::detail
