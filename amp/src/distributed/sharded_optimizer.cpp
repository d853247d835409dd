// SPDX-License-Identifier: BSD-3-Clause
#include "distributed/sharded_optimizer.h"

#include "support/log.h"
#include "optim/eight_bit_state.h"
#include "optim/optimizer_state_load.h"
#include "optim/optimizer_kinds.h"
#include "support/trace_range.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <limits>
#include <sstream>
#include <mutex>
#include <string>
#include <utility>

namespace amp::detail {
namespace {

constexpr size_t kNoPiece = std::numeric_limits<size_t>::max();

void wait(c10::intrusive_ptr<c10d::Work> work) { work->wait(); }

// Waits for `work` at most `timeout`; false if it has not finished by then.
// Bounded only where the host waits for the collective anyway (CPU
// tensors): on a device, wait() orders the stream after it and the host
// goes on, so bounding it would add a host sync per bucket.
bool wait_at_most(const c10::intrusive_ptr<c10d::Work>& work, const at::Tensor& output,
                  std::chrono::milliseconds timeout) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  if (output.is_cpu() && !work->isCompleted()) {
    try {
      future = work->getFuture();
    } catch (const c10::Error&) {  // a backend without futures: no bound
    }
  }
  if (future) {
    struct Signal {
      std::mutex mutex;
      std::condition_variable done;
      bool completed = false;
    };
    auto signal = std::make_shared<Signal>();
    future->addCallback([signal](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lock(signal->mutex);
      signal->completed = true;
      signal->done.notify_all();
    });
    std::unique_lock<std::mutex> lock(signal->mutex);
    if (!signal->done.wait_for(lock, timeout, [&] { return signal->completed; })) return false;
  }
  work->wait();  // the collective's own error, if any
  return true;
}

// shard_weights: a member's bytes go between uses; its TensorImpl, storage,
// sizes and version counter stay (the module, the optimizer's maps and
// autograd's saved tensors hold them), and an op amp does not see that
// reads it meets ATen's "data is not allocated" error.
void release_bytes(const at::Tensor& t) noexcept {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

void allocate_bytes(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() != 0 || t.numel() == 0) return;
  at::Tensor fresh = at::empty({static_cast<int64_t>(t.nbytes())}, t.options().dtype(at::kByte));
  storage->set_data_ptr_noswap(std::move(fresh.storage().unsafeGetStorageImpl()->mutable_data_ptr()));
  storage->set_nbytes(t.nbytes());
}

// The names of the state tensors an optimizer with `options` keeps.
std::vector<const char*> state_names(const torch::optim::OptimizerOptions& options) {
  std::vector<const char*> names;
  int64_t step = 0;
  for (const StateTensor& t : state_tensors(*make_state(options, {}, 0), step)) names.push_back(t.name);
  return names;
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(torch::optim::Optimizer& optimizer, const DataParallel& config,
                                   const ShardDtypes& dtypes, const std::string& name)
    : optimizer_(&optimizer), group_(config.group), rank_(config.group->getRank()),
      world_(config.group->getSize()), rounded_state_(dtypes.rounded_state),
      gather_timeout_(gather_wait(config.gather_timeout, config.group, &group_timeout_)),
      rendezvous_(config.group, config.store, name) {
  stage3_ = config.shard_weights;
  for (const auto& group : optimizer.param_groups()) {
    group_members_.emplace_back();
    for (const at::Tensor& p : group.params()) {
      group_members_.back().push_back(members_.size());
      index_[p.unsafeGetTensorImpl()] = members_.size();
      members_.push_back(p);
    }
  }
  std::vector<int> keys;
  for (const at::Tensor& m : members_) keys.push_back(static_cast<int>(dtypes.compute(m)));
  buckets_ = plan_buckets(members_, keys, config.bucket_bytes, c10::elementSize(config.reduce_dtype));
  piece_of_.assign(members_.size(), {kNoPiece, kNoPiece});
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    ReduceBucket& bucket = buckets_[b];
    bucket.dtype = static_cast<at::ScalarType>(keys[bucket.ids.front()]);
    bucket.stepped_dtype = dtypes.masters ? at::kFloat : bucket.dtype;
    bucket.padded = (bucket.numel + world_ - 1) / world_ * world_;
    const int64_t chunk = bucket.padded / world_, first = rank_ * chunk, last = first + chunk;
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      const at::Tensor& member = bucket.members[j];
      const int64_t begin = std::max(first, bucket.offsets[j]);
      const int64_t end = std::min(last, bucket.offsets[j] + member.numel());
      if (begin >= end) continue;
      ReduceBucket::Piece piece;
      piece.member = j;
      piece.begin = begin - bucket.offsets[j];
      piece.length = end - begin;
      piece.chunk_offset = begin - first;
      const at::ScalarType dtype = dtypes.masters ? at::kFloat : bucket.dtype;  // rounds as lowering does
      piece.stepped = member.detach().to(dtype).reshape(-1).narrow(0, piece.begin, piece.length).clone();
      piece.stepped.requires_grad_(member.requires_grad());
      piece_of_[bucket.ids[j]] = {b, bucket.pieces.size()};
      bucket.pieces.push_back(std::move(piece));
    }
  }
  gather_of_.assign(members_.size(), kNoPiece);
  for (size_t b = buckets_.size(); b-- > 0;) {
    const ReduceBucket& bucket = buckets_[b];
    if (gathers_.empty() || gathers_.back().bytes * world_ >= config.bucket_bytes) gathers_.emplace_back();
    Gather& gather = gathers_.back();
    gather.buckets.push_back(b);
    gather.offsets.push_back(gather.bytes);
    const int64_t chunk_bytes = bucket.padded / world_ * static_cast<int64_t>(c10::elementSize(bucket.dtype));
    gather.bytes += (chunk_bytes + 7) / 8 * 8;
    for (size_t id : bucket.ids) gather_of_[id] = gathers_.size() - 1;
  }
  in_flight_.resize(gathers_.size());
  residency_ = WeightResidency(gathers_.size());
  set_group_params(nullptr);
  // LibTorch's Adagrad makes each parameter's state when it is constructed
  // and steps only parameters that have one: the pieces take that fresh
  // state (initialize refuses any other) in place of the whole parameters.
  if (dynamic_cast<torch::optim::Adagrad*>(optimizer_) != nullptr) {
    optimizer_->state().clear();
    for (auto& group : optimizer_->param_groups()) {
      const double initial = static_cast<const torch::optim::AdagradOptions&>(group.options()).initial_accumulator_value();
      for (const at::Tensor& piece : group.params()) {
        auto state = std::make_unique<torch::optim::AdagradParamState>();
        state->sum(at::full_like(piece, initial, at::MemoryFormat::Preserve));
        optimizer_->state()[piece.unsafeGetTensorImpl()] = std::move(state);
      }
    }
  }
}

const ReduceBucket::Piece* ShardedOptimizer::piece(size_t member) const {
  const auto [b, p] = piece_of_[member];
  return b == kNoPiece ? nullptr : &buckets_[b].pieces[p];
}

at::ScalarType ShardedOptimizer::state_dtype(const ReduceBucket::Piece& piece) const {
  return kept_state_dtype(piece.stepped, rounded_state_);
}

void ShardedOptimizer::set_group_params(const std::vector<at::Tensor>* per_member) {
  auto& groups = optimizer_->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> params;
    for (size_t m : group_members_[g]) {
      if (per_member) {
        params.push_back((*per_member)[m]);
      } else if (const ReduceBucket::Piece* p = piece(m)) {
        params.push_back(p->stepped);
      }
    }
    groups[g].params() = std::move(params);
  }
}

void ShardedOptimizer::record_members() {
  versions_.resize(members_.size());
  storages_.resize(members_.size());
  for (size_t m = 0; m < members_.size(); ++m) record_member(m);
}

void ShardedOptimizer::record_member(size_t m) {
  versions_[m] = members_[m]._version();
  storages_[m] = members_[m].storage().unsafeGetStorageImpl();
}

void ShardedOptimizer::take_member_writes() {
  if (stage3_) return;  // the members hold no values of their own: the pieces are the weights
  at::NoGradGuard no_grad;
  for (size_t m = 0; m < members_.size(); ++m) {
    at::Tensor member = members_[m];
    if (member.storage().unsafeGetStorageImpl() != storages_[m]) {  // replaced: torch::load, set_
      at::Tensor fp32 = foreign_float32_values(member);
      if (fp32.defined()) {
        fp32 = fp32.clone();
        member.set_data(fp32.to(member.scalar_type()));  // the bytes of its own dtype again
      } else {
        fp32 = member.detach().to(at::kFloat);
      }
      take_values(member, fp32);
    } else if (member._version() != versions_[m]) {  // written in place
      const ReduceBucket::Piece* p = piece(m);
      if (!warned_ && p != nullptr && p->stepped.scalar_type() != member.scalar_type()) {
        warned_ = true;
        warn("sharded_master_rebuilt", "a parameter was changed in place while its float32 master "
             "lives in another rank's shard (Options::data_parallel.shard); the master was rebuilt "
             "from the model's " + std::string(c10::toString(member.scalar_type())) + " values. "
             "Load weights with amp::load_checkpoint, or torch::load, which keep float32.");
      }
      take_values(member, member.detach().to(at::kFloat));
    }
  }
}

void ShardedOptimizer::take_values(const at::Tensor& member, const at::Tensor& fp32) {
  const size_t m = index_.at(member.unsafeGetTensorImpl());
  if (const ReduceBucket::Piece* p = piece(m)) {
    at::NoGradGuard no_grad;
    p->stepped.detach().copy_(fp32.reshape(-1).narrow(0, p->begin, p->length));
  }
  versions_[m] = member._version();
  storages_[m] = member.storage().unsafeGetStorageImpl();
}

void ShardedOptimizer::mark_member_gradients() noexcept {
  if (marks_.empty()) {
    for (const at::Tensor& member : members_) {
      at::Tensor mark = at::empty({0}, member.options());
      mark.unsafeGetTensorImpl()->set_sizes_contiguous(member.sizes());  // the member's shape, no bytes
      marks_.push_back(std::move(mark));
    }
  }
  for (size_t m = 0; m < members_.size(); ++m) members_[m].mutable_grad() = marks_[m];
}

void ShardedOptimizer::check_member_gradients() const {
  for (size_t m = 0; m < members_.size(); ++m) {
    const at::Tensor& grad = members_[m].grad();
    TORCH_CHECK(!grad.defined() || (!marks_.empty() && grad.unsafeGetTensorImpl() == marks_[m].unsafeGetTensorImpl()),
                "amp: a model parameter has a gradient before the scale_loss guard: a backward ran outside "
                "amp::scale_loss. With Options::data_parallel.shard the optimizer steps only this rank's shard, "
                "whose gradient the guard reduces; a gradient outside it would be lost. Wrap backward in "
                "amp::scale_loss(loss, optimizer).");
  }
}

void ShardedOptimizer::take_model_zeroing() noexcept {
  if (marks_.empty()) return;
  for (size_t m = 0; m < members_.size(); ++m) {
    at::Tensor& grad = members_[m].mutable_grad();
    if (grad.defined()) continue;
    const auto [b, p] = piece_of_[m];  // model->zero_grad() reset the mark: the program zeroed this parameter
    if (b != kNoPiece) buckets_[b].pieces[p].stepped.mutable_grad().reset();
    grad = marks_[m];
  }
}

void ShardedOptimizer::take_member_gradients() noexcept {
  for (at::Tensor& member : members_) member.mutable_grad().reset();  // marks (zeroing taken at the guard's start)
}

ShardedOptimizer::Sums ShardedOptimizer::sums_with_micro_batch(const HeldGradients& held) const {
  at::NoGradGuard no_grad;
  Sums sums;
  for (const at::Tensor& member : members_) {
    const at::Tensor& grad = member.grad();
    if (!grad.defined()) continue;
    const at::Tensor sum = held.find(member);
    sums.emplace_back(member, sum.defined() ? grad.to(at::kFloat) + sum : grad.to(at::kFloat));  // as the plan sums asides
  }
  return sums;
}

void ShardedOptimizer::gather_for(const at::Tensor& member) {
  auto it = index_.find(member.unsafeGetTensorImpl());
  if (it == index_.end() || gather_of_[it->second] == kNoPiece) return;
  if (stage3_) {
    gather_whole_for_op(gather_of_[it->second]);
    return;
  }
  gather_through(gather_of_[it->second] + 1, /*meet=*/true);
}

void ShardedOptimizer::end_evaluation_round() noexcept {
  const bool training = at::GradMode::is_enabled() || residency_.rerunning();
  if (round_open_ && round_without_grad_ && training) free_members();  // an evaluation's weights go first
}

void ShardedOptimizer::open_round() {
  end_evaluation_round();
  if (round_open_) return;
  const bool training = at::GradMode::is_enabled() || residency_.rerunning();
  TORCH_CHECK(!rendezvous_.available() || rendezvous_.meet(gather_timeout_),
              lone_forward_error("Nothing was started: the process group goes on working, and the weights are "
                                 "gathered at the next forward every rank runs."));
  round_open_ = true;
  round_without_grad_ = !training;
}

void ShardedOptimizer::gather_whole_for_op(size_t g) {
  open_round();
  if (residency_.whole(g)) {
    residency_.read(g);
    return;
  }
  AMP_TRACE_RANGE("amp::all-gather of the weights");
  at::NoGradGuard no_grad;
  if (!in_flight_[g].work) launch(g);
  if (!residency_.in_rerun()) {  // forward order: the next ops' weights travel while this one computes
    for (size_t next = g + 1; next < std::min(gathers_.size(), g + 1 + kAhead); ++next) {
      if (!residency_.whole(next) && !in_flight_[next].work) launch(next);
    }
  }
  take(g);
  residency_.take(g);
}

size_t ShardedOptimizer::begin_run(size_t rerun_of) {
  if (!stage3_) return 0;
  end_evaluation_round();
  const size_t id = residency_.begin_run(rerun_of);
  if (rerun_of == WeightResidency::kForward) return id;
  try {
    open_round();
    at::NoGradGuard no_grad;
    // The block's gathers, then the previous block's where backward reruns
    // it next (not a nested block of an earlier forward of this one's run).
    for (const size_t block : {id, id - 1}) {
      if (block != id && !residency_.siblings(block, id)) continue;
      for (size_t g : residency_.read_by(block)) {
        if (!residency_.whole(g) && !in_flight_[g].work) launch(g);
      }
    }
  } catch (...) {
    end_run();
    throw;
  }
  return id;
}

void ShardedOptimizer::end_run() noexcept {
  if (!stage3_) return;
  for (size_t g : residency_.end_run()) free_gather(g);
}

void ShardedOptimizer::free_gather(size_t g) noexcept {
  for (size_t b : gathers_[g].buckets) {
    for (size_t id : buckets_[b].ids) release_bytes(members_[id]);
  }
}

void ShardedOptimizer::free_members() noexcept {
  if (!stage3_) return;
  for (size_t g = 0; g < gathers_.size(); ++g) {
    if (in_flight_[g].work) {
      try {
        in_flight_[g].work->wait();  // its buffers go with it
      } catch (const std::exception& e) {
        log_error(std::string("a prefetched all-gather of the sharded weights failed: ") + e.what());
      }
      in_flight_[g] = InFlight();
    }
    free_gather(g);
  }
  residency_.end_round();
  round_open_ = false;
}

std::string ShardedOptimizer::lone_forward_error(const char* outcome) const {
  std::ostringstream why;
  why << "amp: rank " << rank_ << " waited " << gather_timeout_.count() << " ms for the other ranks at the "
      << "all-gather of the sharded weights ";
  if (stage3_) {
    why << "(Options::data_parallel.shard_weights), which every forward runs for the weights it reads. Every rank "
        << "must run every forward: a forward on one rank alone (evaluation or sampling on rank 0) waits for ranks "
        << "that never come. Run it on every rank, or set shard_weights = false (amp's fused optimizers then leave "
        << "the weights gathered after their step). ";
  } else {
    why << "(Options::data_parallel.shard), which runs at the first op of the forward after a step of LibTorch's "
        << "own optimizer. Every rank must run that forward: a forward on one rank alone (evaluation or sampling "
        << "on rank 0) waits for ranks that never come. Run it on every rank, or step with "
        << "amp::optim::FusedAdam, FusedAdamW or FusedSGD, which gather at the end of their step so that no "
        << "forward needs a collective. ";
  }
  why << outcome << " The wait is data_parallel.gather_timeout (raise it if ranks legitimately reach the forward "
      << "further apart)";
  if (group_timeout_.count() > 0) {
    why << ", at most half the process group's own timeout of " << group_timeout_.count() << " ms";
  }
  why << ".";
  return why.str();
}

void ShardedOptimizer::gather_through(size_t count, bool meet) {
  if (stage3_ || !stale_ || taken_ >= count) return;  // ZeRO-3 gathers op by op (gather_whole_for_op)
  AMP_TRACE_RANGE("amp::all-gather of the weights");
  if (launched_ == 0 && taken_ == 0) {
    TORCH_CHECK(!meet || !rendezvous_.available() || rendezvous_.meet(gather_timeout_),
                lone_forward_error("Nothing was started: the process group goes on working, and the weights are "
                                   "gathered at the next forward every rank runs."));
    take_member_writes();  // before the gather overwrites the members
  }
  at::NoGradGuard no_grad;
  while (taken_ < count) {
    while (launched_ < std::min(gathers_.size(), taken_ + 1 + kAhead)) launch(launched_++);
    take(taken_++);
  }
  // Prefetch: the next buckets travel while this op computes.
  while (launched_ < std::min(gathers_.size(), taken_ + kAhead)) launch(launched_++);
  if (taken_ == gathers_.size()) {
    stale_ = false;
    launched_ = taken_ = 0;
  }
}

// Starts gather `g`: this rank's chunk of each of its buckets, rounded to
// the bucket's compute dtype, into the bytes of one all-gather.
void ShardedOptimizer::launch(size_t g) {
  const Gather& gather = gathers_[g];
  const auto bytes = buckets_[gather.buckets.front()].members.front().options().dtype(at::kByte);
  at::Tensor mine = at::zeros({gather.bytes}, bytes);
  std::vector<at::Tensor> dst, src;
  for (size_t i = 0; i < gather.buckets.size(); ++i) {
    const ReduceBucket& bucket = buckets_[gather.buckets[i]];
    const int64_t chunk = bucket.padded / world_;
    const at::Tensor region = mine.narrow(0, gather.offsets[i], chunk * c10::elementSize(bucket.dtype)).view(bucket.dtype);
    for (const ReduceBucket::Piece& p : bucket.pieces) {
      dst.push_back(region.narrow(0, p.chunk_offset, p.length));
      src.push_back(p.stepped.detach());
    }
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);  // rounds to the compute dtypes
  InFlight& flight = in_flight_[g];
  flight.whole = at::empty({gather.bytes * world_}, bytes);
  flight.work = group_->_allgather_base(flight.whole, mine);
}

// Waits for gather `g` and copies its buckets' wholes into the members.
void ShardedOptimizer::take(size_t g) {
  InFlight& flight = in_flight_[g];
  if (!wait_at_most(flight.work, flight.whole, gather_timeout_)) {
    TORCH_CHECK(false, lone_forward_error("The gather stays started (this process group's store is out of amp's "
                                          "reach: pass it as data_parallel.store to start nothing instead): the "
                                          "next op over the weights waits for it again."));
  }
  const Gather& gather = gathers_[g];
  if (stage3_) {
    for (size_t b : gather.buckets) {
      for (size_t id : buckets_[b].ids) allocate_bytes(members_[id]);
    }
  }
  const at::Tensor parts = flight.whole.view({world_, gather.bytes});
  std::vector<at::Tensor> dst, src;
  for (size_t i = 0; i < gather.buckets.size(); ++i) {
    const ReduceBucket& bucket = buckets_[gather.buckets[i]];
    const int64_t chunk = bucket.padded / world_;
    // Every rank's chunk, in rank order: the bucket whole (a copy when the
    // parts hold other buckets' bytes between the chunks).
    const at::Tensor whole =
        parts.narrow(1, gather.offsets[i], chunk * c10::elementSize(bucket.dtype)).view(bucket.dtype).reshape(-1);
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      const at::Tensor& member = members_[bucket.ids[j]];
      dst.push_back(member.detach());
      src.push_back(whole.narrow(0, bucket.offsets[j], member.numel()).view(member.sizes()));
    }
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);
  flight = InFlight();  // the work holds its tensors too
  for (size_t b : gather.buckets) {
    for (size_t id : buckets_[b].ids) record_member(id);
  }
}

std::vector<at::Tensor> ShardedOptimizer::gather_whole(
    const std::function<at::Tensor(const ReduceBucket::Piece&)>& value) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out(members_.size());
  for (const ReduceBucket& bucket : buckets_) {
    const auto options = bucket.members.front().options().dtype(at::kFloat);
    at::Tensor mine = at::zeros({bucket.padded / world_}, options);
    for (const ReduceBucket::Piece& p : bucket.pieces) {
      if (at::Tensor v = value(p); v.defined()) mine.narrow(0, p.chunk_offset, p.length).copy_(v.reshape(-1));
    }
    at::Tensor whole = at::empty({bucket.padded}, options);
    wait(group_->_allgather_base(whole, mine));
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      const at::Tensor& member = bucket.members[j];
      out[bucket.ids[j]] = whole.narrow(0, bucket.offsets[j], member.numel()).view(member.sizes()).clone();
    }
  }
  for (size_t m = 0; m < members_.size(); ++m) {  // members in no bucket (no elements)
    if (!out[m].defined()) out[m] = at::zeros(members_[m].sizes(), members_[m].options().dtype(at::kFloat));
  }
  return out;
}

std::vector<at::Tensor> ShardedOptimizer::full_masters() {
  return gather_whole([](const ReduceBucket::Piece& p) { return p.stepped.detach(); });
}

ShardedOptimizer::StateMap ShardedOptimizer::whole_state(const std::vector<at::Tensor>& whole) {
  const auto& groups = optimizer_->param_groups();
  if (groups.empty()) return {};
  const std::vector<const char*> names = state_names(groups.front().options());
  // Per member: its step count (-1: no state yet) and which state tensors
  // it has, agreed by every rank (those without a piece of it know nothing).
  const int64_t columns = 1 + static_cast<int64_t>(names.size());
  at::Tensor meta = at::full({static_cast<int64_t>(members_.size()), columns}, -1.0, at::kDouble);
  auto known = [&](const ReduceBucket::Piece& p) -> const torch::optim::OptimizerParamState* {
    auto it = optimizer_->state().find(p.stepped.unsafeGetTensorImpl());
    return it == optimizer_->state().end() ? nullptr : it->second.get();
  };
  for (size_t m = 0; m < members_.size(); ++m) {
    const ReduceBucket::Piece* p = piece(m);
    const torch::optim::OptimizerParamState* state = p ? known(*p) : nullptr;
    if (!state) continue;
    int64_t step = 0;
    const std::vector<StateTensor> tensors = state_tensors(*state, step);
    meta[m][0] = static_cast<double>(step);
    for (size_t k = 0; k < tensors.size(); ++k) meta[m][k + 1] = tensors[k].value.defined() ? 1.0 : 0.0;
  }
  meta = meta.to(members_.empty() ? c10::Device(c10::kCPU) : members_.front().device());
  {
    std::vector<at::Tensor> tensors{meta};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    wait(group_->allreduce(tensors, max));
  }
  meta = meta.cpu();
  std::vector<std::vector<at::Tensor>> values(names.size());
  for (size_t k = 0; k < names.size(); ++k) {
    if (meta.narrow(1, static_cast<int64_t>(k) + 1, 1).max().item<double>() <= 0) continue;
    values[k] = gather_whole([&](const ReduceBucket::Piece& p) -> at::Tensor {
      const torch::optim::OptimizerParamState* state = known(p);
      if (!state) return {};
      int64_t step = 0;
      return state_values(state_tensors(*state, step)[k].value, p.stepped, non_negative_state(names[k]));
    });
  }
  StateMap state;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t m : group_members_[g]) {
      const int64_t step = static_cast<int64_t>(meta[m][0].item<double>());
      if (step < 0) continue;
      std::vector<StateTensor> tensors;
      for (size_t k = 0; k < names.size(); ++k) {
        if (meta[m][k + 1].item<double>() > 0) tensors.push_back({names[k], values[k][m], false});
      }
      state[whole[m].unsafeGetTensorImpl()] = make_state(groups[g].options(), tensors, step);
    }
  }
  return state;
}

void ShardedOptimizer::save(torch::serialize::OutputArchive& archive) {
  const std::vector<at::Tensor> whole = full_masters();
  StateMap state = whole_state(whole);
  std::swap(optimizer_->state(), state);
  set_group_params(&whole);
  try {
    optimizer_->save(archive);
  } catch (...) {
    std::swap(optimizer_->state(), state);
    set_group_params(nullptr);
    throw;
  }
  std::swap(optimizer_->state(), state);
  set_group_params(nullptr);
}

void ShardedOptimizer::load(torch::serialize::InputArchive& archive) {
  std::vector<at::Tensor> whole;
  for (const at::Tensor& m : members_) whole.push_back(at::zeros(m.sizes(), m.options().dtype(at::kFloat)));
  StateMap sharded = std::move(optimizer_->state());
  optimizer_->state().clear();
  set_group_params(&whole);
  try {
    // The whole state in float32, whatever dtype it was saved in.
    const StateDtype float32 = [](const at::Tensor&) { return at::kFloat; };
    optimizer_->load(archive);
    convert_state(*optimizer_, float32);
    check_state_fits_params(*optimizer_, float32);
  } catch (const std::exception& e) {
    optimizer_->state() = std::move(sharded);
    set_group_params(nullptr);
    TORCH_CHECK(false, "amp: cannot load the optimizer's state; nothing was changed. Was it saved "
                "from the same model and optimizer? Cause: ", message_of(e));
  }
  // Each piece takes its slice of its member's whole state.
  StateMap pieces;
  const auto& groups = optimizer_->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t m : group_members_[g]) {
      const ReduceBucket::Piece* p = piece(m);
      auto it = optimizer_->state().find(whole[m].unsafeGetTensorImpl());
      if (!p || it == optimizer_->state().end()) continue;
      int64_t step = 0;
      std::vector<StateTensor> tensors = state_tensors(*it->second, step);
      for (StateTensor& t : tensors) {
        if (t.value.defined()) {
          t.value = state_kept_as(t.value.reshape(-1).narrow(0, p->begin, p->length), state_dtype(*p),
                                  non_negative_state(t.name));
        }
      }
      pieces[p->stepped.unsafeGetTensorImpl()] = make_state(groups[g].options(), tensors, step);
    }
  }
  optimizer_->state() = std::move(pieces);
  set_group_params(nullptr);
}

bool ShardedOptimizer::optimizer_alive() const {
  // The pieces are held by the buckets and by the optimizer's param groups.
  for (const ReduceBucket& bucket : buckets_) {
    for (const ReduceBucket::Piece& p : bucket.pieces) {
      if (p.stepped.use_count() < 2) return false;
    }
  }
  return true;
}

void ShardedOptimizer::restore() {
  free_members();  // shard_weights: gathers in flight end first
  for (size_t m = 0; m < marks_.size(); ++m) {
    if (members_[m].grad().unsafeGetTensorImpl() == marks_[m].unsafeGetTensorImpl()) members_[m].mutable_grad().reset();
  }
  // A program may destroy its optimizer before amp ends: then only the
  // model gets its float32 weights back. Every rank takes the same path.
  at::Tensor alive = at::full({1}, optimizer_alive() ? 1.0f : 0.0f,
                              members_.empty() ? at::TensorOptions() : members_.front().options().dtype(at::kFloat));
  {
    std::vector<at::Tensor> tensors{alive};
    c10d::AllreduceOptions min;
    min.reduceOp = c10d::ReduceOp::MIN;
    wait(group_->allreduce(tensors, min));
  }
  const std::vector<at::Tensor> whole = full_masters();
  StateMap state;
  const bool with_optimizer = alive.item<float>() > 0;
  if (with_optimizer) state = whole_state(whole);
  at::NoGradGuard no_grad;
  StateMap by_member;
  for (size_t m = 0; m < members_.size(); ++m) {
    members_[m].set_data(whole[m]);
    auto it = state.find(whole[m].unsafeGetTensorImpl());
    if (it != state.end()) by_member[members_[m].unsafeGetTensorImpl()] = std::move(it->second);
  }
  if (!with_optimizer) return;
  optimizer_->state() = std::move(by_member);
  set_group_params(&members_);
}

ShardedMasters::ShardedMasters(const std::vector<torch::optim::Optimizer*>& optimizers,
                               const DataParallel& config, const ShardDtypes& dtypes)
    : group_(config.group), shards_weights_(config.shard_weights) {
  // Every rank initializes as often as the others (it is a collective), so
  // the count names this initialization alike on every rank.
  static std::atomic<uint64_t> initializations{0};
  const std::string name = std::to_string(initializations++);
  for (size_t i = 0; i < optimizers.size(); ++i) {
    optimizers_.push_back(
        std::make_unique<ShardedOptimizer>(*optimizers[i], config, dtypes, name + "/" + std::to_string(i)));
  }
}

ShardedOptimizer* ShardedMasters::of(const torch::optim::Optimizer& optimizer) {
  for (auto& s : optimizers_) {
    if (&s->optimizer() == &optimizer) return s.get();
  }
  return nullptr;
}

void ShardedMasters::record_members() {
  for (auto& s : optimizers_) s->record_members();
}

bool ShardedMasters::stale() const {
  for (const auto& s : optimizers_) {
    if (s->stale()) return true;
  }
  return false;
}

bool ShardedMasters::owns(const at::Tensor& t) const {
  for (const auto& s : optimizers_) {
    if (s->owns(t)) return true;
  }
  return false;
}

void ShardedMasters::sync() {
  for (auto& s : optimizers_) {
    if (!s->stale()) s->take_member_writes();  // a gather starting takes them itself
  }
  for (auto& s : optimizers_) s->gather();
}

void ShardedMasters::sync_for(const at::Tensor& t) {
  for (auto& s : optimizers_) s->gather_for(t);
}

void ShardedMasters::gather_after_step(const torch::optim::Optimizer& optimizer) {
  if (ShardedOptimizer* s = of(optimizer)) s->gather(/*after_step=*/true);
}

size_t ShardedMasters::begin_block(size_t rerun_of) {
  size_t id = 0;
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    try {
      id = optimizers_[i]->begin_run(rerun_of);
    } catch (...) {
      while (i-- > 0) optimizers_[i]->end_run();
      throw;
    }
  }
  if (shards_weights_) weights_freed();  // a forward's begin ends an evaluation's round
  return id;
}

void ShardedMasters::end_block() noexcept {
  for (auto& s : optimizers_) s->end_run();
  if (shards_weights_) weights_freed();
}

void ShardedMasters::free_weights() noexcept {
  for (auto& s : optimizers_) s->free_members();
  if (shards_weights_) weights_freed();
}

void ShardedMasters::take_model_zeroing() noexcept {
  for (auto& s : optimizers_) s->take_model_zeroing();
}

void ShardedMasters::take_member_gradients() {
  for (const auto& s : optimizers_) s->check_member_gradients();  // before any change
  for (auto& s : optimizers_) s->take_member_gradients();
}

bool ShardedMasters::take_values(const at::Tensor& member, const at::Tensor& fp32) {
  for (auto& s : optimizers_) {
    if (s->owns(member)) {
      s->take_values(member, fp32);
      return true;
    }
  }
  return false;
}

void ShardedMasters::clear_member_gradients() noexcept {
  for (auto& s : optimizers_) s->mark_member_gradients();
}

}  // namespace amp::detail
