// SPDX-License-Identifier: BSD-3-Clause
#include "distributed/gradient_reducer.h"

#include "support/host_read.h"
#include "optim/non_finite_check.h"
#include "support/trace_range.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace amp::detail {

std::vector<ReduceBucket> plan_buckets(const std::vector<at::Tensor>& members,
                                       const std::vector<int>& keys, int64_t bucket_bytes,
                                       int64_t element_size) {
  std::vector<ReduceBucket> buckets;
  std::map<int, size_t> open;  // per key: its bucket being filled
  for (size_t i = members.size(); i-- > 0;) {
    if (keys[i] < 0) continue;
    auto it = open.find(keys[i]);
    if (it == open.end() || buckets[it->second].numel * element_size >= bucket_bytes) {
      buckets.emplace_back();
      it = open.insert_or_assign(keys[i], buckets.size() - 1).first;
    }
    ReduceBucket& bucket = buckets[it->second];
    bucket.members.push_back(members[i]);
    bucket.ids.push_back(i);
    bucket.offsets.push_back(bucket.numel);
    bucket.numel += members[i].numel();
  }
  return buckets;
}

struct GradientReducer::Layout {
  std::vector<int64_t> numels;  // per slot, to see a parameter resized
  std::vector<ReduceBucket> buckets;
};

GradientReducer::GradientReducer(DataParallel config)
    : config_(std::move(config)), rank_(config_.group->getRank()), world_(config_.group->getSize()) {}

GradientReducer::~GradientReducer() = default;

namespace {

// A whole-sums bucket's elements: its padded sums, then one flag per member.
int64_t sums_and_flags(const ReduceBucket& bucket) {
  return bucket.padded + static_cast<int64_t>(bucket.members.size());
}

// An unwound guard's collective may still be running on a bucket's buffers.
void drain(ReduceBucket& bucket) {
  if (!bucket.work) return;
  bucket.work.reset();
  if (bucket.flat.defined()) bucket.flat = at::zeros_like(bucket.flat);
  bucket.chunk = at::Tensor();
}

}  // namespace

std::unique_ptr<GradientReducer::Reduction> GradientReducer::start(std::vector<GradSlot>& slots) {
  // Parameters that cannot have a gradient (requires_grad false) stay out,
  // so a frozen layer costs nothing; freezing or unfreezing changes the key.
  std::vector<const void*> key;
  std::vector<int64_t> numels;
  std::vector<at::Tensor> params;
  std::vector<int> keys;
  for (const GradSlot& s : slots) {
    key.push_back(s.param.requires_grad() ? s.param.unsafeGetTensorImpl() : nullptr);
    numels.push_back(s.param.numel());
    params.push_back(s.param);
    keys.push_back(s.param.requires_grad() ? 0 : -1);
  }
  std::unique_ptr<Layout>& layout = layouts_[key];
  if (!layout || layout->numels != numels) {
    layout = std::make_unique<Layout>();
    layout->numels = numels;
    layout->buckets = plan_buckets(params, keys, config_.bucket_bytes, c10::elementSize(config_.reduce_dtype));
    for (ReduceBucket& bucket : layout->buckets) {
      bucket.flat = at::zeros({bucket.numel + static_cast<int64_t>(bucket.members.size())},
                              bucket.members.front().options().dtype(config_.reduce_dtype).requires_grad(false));
    }
  }
  std::vector<ReduceBucket*> buckets;
  for (ReduceBucket& bucket : layout->buckets) {
    drain(bucket);
    bucket.members.clear();  // this guard's parameters (the same tensors, or their new handles)
    for (size_t id : bucket.ids) bucket.members.push_back(slots[id].param);
    buckets.push_back(&bucket);
  }
  return std::make_unique<Reduction>(*this, std::move(buckets), &slots);
}

std::unique_ptr<GradientReducer::Reduction> GradientReducer::start_sharded(const std::vector<ShardedOwner>& owners,
                                                                            PiecesFinal pieces_final) {
  std::vector<ReduceBucket*> buckets;
  std::vector<const HeldGradients*> sums;
  for (const ShardedOwner& owner : owners) {
    for (ReduceBucket& bucket : *owner.buckets) {
      drain(bucket);
      buckets.push_back(&bucket);
      sums.push_back(owner.sums);
    }
  }
  return std::make_unique<Reduction>(*this, std::move(buckets), nullptr, std::move(sums), std::move(pieces_final));
}

GradientReducer::Reduction::Reduction(GradientReducer& reducer, std::vector<ReduceBucket*> buckets,
                                      std::vector<GradSlot>* slots, std::vector<const HeldGradients*> sums,
                                      PiecesFinal pieces_final)
    : reducer_(reducer), buckets_(std::move(buckets)), slots_(slots), sums_(std::move(sums)),
      pieces_final_(std::move(pieces_final)), handed_over_(buckets_.size(), false) {
  // Gloo reduce-scatters by all-reducing the whole buffer and keeping the
  // chunk: all-reducing it here costs the same and leaves every rank the
  // whole sums, so the members' "used" flags ride in the bucket and the
  // overflow is read from the sums, without two more collectives a guard.
  whole_sums_ = sharded() && reducer_.config_.group->getBackendName() == "gloo";
  if (whole_sums_) used_.resize(buckets_.size());
  for (const ReduceBucket* bucket : buckets_) {
    first_member_.push_back(produced_.size());
    missing_.push_back(static_cast<int64_t>(bucket->members.size()));
    produced_.resize(produced_.size() + bucket->members.size(), false);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (size_t j = 0; j < buckets_[b]->members.size(); ++j) {
      // A parameter without an accumulator is in no live graph: backward
      // cannot produce its gradient, and finish() counts it zero.
      const size_t member = first_member_[b] + j;
      hooks_.add(buckets_[b]->members[j], [this, member] { on_gradient(member); });
    }
  }
}

GradientReducer::Reduction::~Reduction() { hooks_.clear(); }  // before the members its hooks use

void GradientReducer::Reduction::on_gradient(size_t member) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (produced_[member]) {
    if (error_.empty()) {
      error_ = "amp: a parameter's gradient was accumulated twice inside one data-parallel "
               "scale_loss guard (two backward passes through it); its bucket was already being "
               "averaged. Run each backward in its own guard, or accumulate with delay_unscale=true.";
    }
    return;
  }
  produced_[member] = true;
  const size_t b = std::upper_bound(first_member_.begin(), first_member_.end(), member) - first_member_.begin() - 1;
  --missing_[b];
  start_ready_buckets();
}

at::Tensor GradientReducer::Reduction::earlier_sum(size_t b, size_t j) const {
  if (sharded()) return sums_[b]->find(buckets_[b]->members[j]);
  const GradSlot& slot = (*slots_)[buckets_[b]->ids[j]];
  return slot.aside_scaled ? slot.aside : at::Tensor();
}

// Copies the bucket's gradients in: this backward's, plus an accumulation's
// earlier micro-batches (scaled asides, or ZeRO-1's sums); zero for a member
// without any.
void GradientReducer::Reduction::fill(size_t b) {
  ReduceBucket& bucket = *buckets_[b];
  at::NoGradGuard no_grad;
  const int64_t members = static_cast<int64_t>(bucket.members.size());
  if (sharded()) {
    // whole_sums: start_ready_buckets placed the flat in its collective's buffer.
    if (!whole_sums()) {
      bucket.flat = at::zeros({bucket.padded}, bucket.members.front().options().dtype(reducer_.config_.reduce_dtype));
    }
    bucket.chunk = at::empty({bucket.padded / reducer_.world_}, bucket.flat.options());
  }
  at::Tensor flags = !sharded()     ? bucket.flat.narrow(0, bucket.numel, members)
                     : whole_sums() ? bucket.flat.narrow(0, bucket.padded, members)
                                    : at::Tensor();
  if (flags.defined()) flags.fill_(1);
  std::vector<at::Tensor> dst, src, aside_dst, asides;
  for (int64_t j = 0; j < members; ++j) {
    const at::Tensor& member = bucket.members[j];
    at::Tensor grad = member.grad();
    if (grad.defined() && grad.is_sparse()) {
      if (error_.empty()) {
        error_ = "amp: data-parallel averaging needs dense gradients, but a parameter's gradient "
                 "is sparse (Embedding with sparse=true?); use sparse=false.";
      }
      grad = at::Tensor();
    }
    at::Tensor region = bucket.flat.narrow(0, bucket.offsets[j], member.numel()).view(member.sizes());
    const at::Tensor aside = earlier_sum(b, j);
    if (grad.defined()) {
      dst.push_back(region);
      src.push_back(grad);
    } else {
      region.zero_();
      if (flags.defined() && !aside.defined()) flags.narrow(0, j, 1).zero_();
    }
    if (aside.defined()) {
      aside_dst.push_back(region);
      asides.push_back(aside);
    }
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);
  if (!aside_dst.empty()) at::_foreach_add_(aside_dst, asides);
  // Sharded: the pieces receive the average; the full gradients go now.
  if (sharded()) {
    for (const at::Tensor& member : bucket.members) member.mutable_grad() = at::Tensor();
  }
  // A low-precision sum of world gradients could overflow where their mean
  // does not: divide first (DDP's pre-division).
  if (c10::isReducedFloatingType(bucket.flat.scalar_type())) {
    bucket.flat.narrow(0, 0, bucket.numel).div_(reducer_.world_);
  }
}

// The bucket's whole sums are in: keeps this rank's chunk and the members'
// flags, and adds the sums' inf/NaN to the guard's.
void GradientReducer::Reduction::keep_chunk(size_t b) {
  ReduceBucket& bucket = *buckets_[b];
  at::NoGradGuard no_grad;
  const int64_t chunk = bucket.padded / reducer_.world_;
  bucket.chunk.copy_(bucket.flat.narrow(0, reducer_.rank_ * chunk, chunk));
  // A copy: a float32 flat's narrow would be a view keeping the whole bucket (and
  // the buffer of the buckets reduced with it) alive until the guard ends.
  used_[b] = bucket.flat.narrow(0, bucket.padded, static_cast<int64_t>(bucket.members.size()))
                 .to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  if (!agreed_non_finite_.defined()) agreed_non_finite_ = at::zeros({1}, bucket.flat.options().dtype(at::kFloat));
  std::vector<at::Tensor> sums{bucket.flat.narrow(0, 0, bucket.numel)};
  non_finite_check_and_unscale(sums, agreed_non_finite_, at::ones({1}, agreed_non_finite_.options()));  // x * 1: a check
}

void GradientReducer::Reduction::start_ready_buckets() {
  if (whole_sums()) {
    // Buckets ready together (the last ones of backward; dtypes the model
    // computes in apart, as BatchNorm's float32 beside bfloat16) travel in
    // one collective: on Gloo each costs about as much as a small one's
    // bytes. Their flats (sums, then the members' flags) lie side by side in
    // one buffer, which the all-reduce takes as it is: no copy in or out.
    size_t end = next_bucket_;
    int64_t total = 0;
    for (; end < buckets_.size() && missing_[end] == 0; ++end) total += sums_and_flags(*buckets_[end]);
    if (end == next_bucket_) return;
    const at::Tensor together = at::zeros(
        {total}, buckets_[next_bucket_]->members.front().options().dtype(reducer_.config_.reduce_dtype));
    int64_t offset = 0;
    std::vector<ReduceBucket*> started;
    while (next_bucket_ < end) {
      AMP_TRACE_RANGE("amp::reduce-scatter (bucket)");
      ReduceBucket& bucket = *buckets_[next_bucket_];
      bucket.flat = together.narrow(0, offset, sums_and_flags(bucket));
      offset += bucket.flat.numel();
      started.push_back(&bucket);
      fill(next_bucket_++);
    }
    std::vector<at::Tensor> tensors{together};
    c10::intrusive_ptr<c10d::Work> work = reducer_.config_.group->allreduce(tensors);
    for (ReduceBucket* bucket : started) bucket->work = work;
    release_reduced(/*in_flight=*/2);
    return;
  }
  while (next_bucket_ < buckets_.size() && missing_[next_bucket_] == 0) {
    ReduceBucket& bucket = *buckets_[next_bucket_];
    AMP_TRACE_RANGE(sharded() ? "amp::reduce-scatter (bucket)" : "amp::all-reduce (bucket)");
    fill(next_bucket_++);
    if (sharded()) {
      bucket.work = reducer_.config_.group->_reduce_scatter_base(bucket.chunk, bucket.flat);
      release_reduced(/*in_flight=*/2);
    } else {
      std::vector<at::Tensor> tensors{bucket.flat};
      bucket.work = reducer_.config_.group->allreduce(tensors);
    }
  }
}

void GradientReducer::Reduction::release_reduced(size_t in_flight) {
  while (released_ < next_bucket_) {
    ReduceBucket& bucket = *buckets_[released_];
    const bool done = bucket.work == nullptr || bucket.work->isCompleted();
    if (!done && next_bucket_ - released_ <= in_flight) return;
    if (bucket.work) {
      AMP_TRACE_RANGE("amp::wait for a reduction");
      bucket.work->wait();
      bucket.work.reset();
    }
    if (whole_sums()) keep_chunk(released_);
    bucket.flat = at::Tensor();  // the chunk holds this rank's part
    average_chunk(bucket);
    if (pieces_final_ && error_.empty()) hand_over(released_);
    ++released_;
  }
}

void GradientReducer::Reduction::hand_over(size_t b) {
  const size_t first = first_member_[b], end = first + buckets_[b]->members.size();
  for (size_t m = first; m < end; ++m) {
    // finish() started it: whether the pieces get gradients is the ranks'
    // agreement, which install_sharded reads.
    if (!produced_[m]) return;
  }
  install_bucket(b, [](size_t) { return true; });
  std::vector<at::Tensor> pieces;
  for (const ReduceBucket::Piece& piece : buckets_[b]->pieces) pieces.push_back(piece.stepped);
  handed_over_[b] = true;
  if (!pieces.empty()) pieces_final_(pieces);
}

void GradientReducer::Reduction::average_chunk(ReduceBucket& bucket) {
  if (bucket.pieces.empty()) return;
  at::NoGradGuard no_grad;
  // A low-precision bucket was divided before its reduction (fill).
  if (!c10::isReducedFloatingType(reducer_.config_.reduce_dtype)) bucket.chunk.div_(reducer_.world_);
  const at::ScalarType stepped = bucket.pieces.front().stepped.scalar_type();
  if (stepped != bucket.chunk.scalar_type()) bucket.chunk = bucket.chunk.to(stepped);
}

void GradientReducer::Reduction::finish() {
  hooks_.clear();
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t& m : missing_) m = 0;  // what backward did not produce counts zero
  start_ready_buckets();
  // Sharded: which members had a gradient on some rank travels apart (the
  // buckets are scattered), one flag per member.
  at::Tensor used;
  c10::intrusive_ptr<c10d::Work> used_work;
  if (sharded() && !whole_sums() && !produced_.empty()) {
    std::vector<float> flags(produced_.begin(), produced_.end());
    for (size_t b = 0; b < buckets_.size(); ++b) {
      for (size_t j = 0; j < buckets_[b]->members.size(); ++j) {
        if (earlier_sum(b, j).defined()) flags[first_member_[b] + j] = 1;
      }
    }
    used = at::tensor(flags).to(buckets_.front()->members.front().device());  // a chunk may be gone (hand_over)
    std::vector<at::Tensor> tensors{used};
    used_work = reducer_.config_.group->allreduce(tensors);
  }
  if (sharded()) {
    release_reduced(/*in_flight=*/0);
  } else {
    for (ReduceBucket* bucket : buckets_) {
      bucket->work->wait();
      bucket->work.reset();
    }
  }
  if (used_work) used_work->wait();
  if (whole_sums() && !buckets_.empty()) used = at::cat(used_);
  for (const ReduceBucket* bucket : buckets_) {
    if (bucket->stepped_dtype != at::kFloat) agreed_non_finite_ = at::Tensor();  // rounding may overflow
  }
  TORCH_CHECK(error_.empty(), error_);
  if (sharded()) {
    install_sharded(used);
  } else {
    install_replicated();
  }
}

void GradientReducer::Reduction::install_replicated() {
  // A parameter this rank has no gradient for keeps none unless another
  // rank had one: only then are the summed flags read (on the host).
  std::vector<at::Tensor> views, unknown_flags;
  std::vector<size_t> order, unknown;
  for (const ReduceBucket* bucket : buckets_) {
    for (size_t j = 0; j < bucket->members.size(); ++j) {
      const size_t s = bucket->ids[j];
      const GradSlot& slot = (*slots_)[s];
      views.push_back(bucket->flat.narrow(0, bucket->offsets[j], slot.param.numel()).view(slot.param.sizes()));
      order.push_back(s);
      const bool local = produced_[views.size() - 1] || slot.param.grad().defined() ||
                         (slot.aside_scaled && slot.aside.defined());
      if (!local) {
        unknown.push_back(order.size() - 1);
        unknown_flags.push_back(bucket->flat.narrow(0, bucket->numel + static_cast<int64_t>(j), 1));
      }
    }
  }
  if (views.empty()) return;
  at::NoGradGuard no_grad;
  const bool predivided = c10::isReducedFloatingType(reducer_.config_.reduce_dtype);
  std::vector<at::Tensor> averages = at::_foreach_div(views, predivided ? 1 : reducer_.world_);
  std::vector<double> used;
  if (!unknown.empty()) used = read_to_host(unknown_flags);
  for (size_t u = 0; u < unknown.size(); ++u) {
    if (used[u] == 0) averages[unknown[u]] = at::Tensor();  // no rank had a gradient
  }
  for (size_t i = 0; i < order.size(); ++i) {
    GradSlot& slot = (*slots_)[order[i]];
    slot.param.mutable_grad() = std::move(averages[i]);
    slot.aside_reduced = slot.aside_scaled && slot.aside.defined();
  }
}

void GradientReducer::Reduction::install_sharded(const at::Tensor& used) {
  // A member this rank had a gradient for: produced now, or summed earlier.
  std::vector<bool> local = produced_;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (size_t j = 0; j < buckets_[b]->members.size(); ++j) {
      if (earlier_sum(b, j).defined()) local[first_member_[b] + j] = true;
    }
  }
  bool all_local = true;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (const ReduceBucket::Piece& piece : buckets_[b]->pieces) all_local = all_local && local[first_member_[b] + piece.member];
  }
  std::vector<double> used_on_host;
  if (!all_local) {  // a piece of a member this rank had no gradient for
    used_on_host = read_to_host({used});
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (handed_over_[b]) continue;  // stepped in backward: its gradients are gone
    install_bucket(b, [&](size_t member) { return local[member] || used_on_host.at(member) > 0; });
  }
}

void GradientReducer::Reduction::install_bucket(size_t b, const std::function<bool(size_t member)>& gets) {
  at::NoGradGuard no_grad;
  ReduceBucket* bucket = buckets_[b];
  // The pieces' gradients share the averaged chunk's storage, so a rank
  // holds its part of the gradients once. They alias it through set_, not
  // as autograd views, which LibTorch's zero_grad (detach_) refuses.
  const at::Tensor& chunk = bucket->chunk;
  for (const ReduceBucket::Piece& piece : bucket->pieces) {
    at::Tensor grad;
    if (gets(first_member_[b] + piece.member)) {
      grad = at::empty({0}, chunk.options());
      grad.set_(chunk.storage(), chunk.storage_offset() + piece.chunk_offset, {piece.length}, {1});
    }
    piece.stepped.mutable_grad() = std::move(grad);
  }
  bucket->flat = at::Tensor();  // only the pieces' gradients stay
  bucket->chunk = at::Tensor();
}

}  // namespace amp::detail
