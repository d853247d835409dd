// SPDX-License-Identifier: BSD-3-Clause
#include "interception/cast_cache.h"
#include <amp/internal/level_rules.h>

#include <amp/cast_cache.h>
#include <amp/opt_levels.h>

#include "interception/dispatch/call_record.h"
#include "interception/dispatch/cast.h"
#include "support/trace_range.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

namespace amp {
namespace detail {
namespace {

// Cast counts per thread, summed when read: a cast writes only its own
// thread's counters - no locked instruction, no cache line shared between
// threads on the hot path. The registry owns every thread's counters; a
// thread that ends folds its counts into `retired_` and frees its slot.
struct ThreadCounts {
  std::atomic<int64_t> casts{0};  // atomic for the reader; written by one thread only
  std::atomic<int64_t> hits{0};
};

class CountRegistry {
 public:
  ThreadCounts* enlist() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) {
      slots_.push_back(std::make_unique<ThreadCounts>());
      return slots_.back().get();
    }
    ThreadCounts* counts = free_.back();
    free_.pop_back();
    return counts;
  }
  void retire(ThreadCounts* counts) {
    std::lock_guard<std::mutex> lock(mutex_);
    retired_.casts += counts->casts.exchange(0, std::memory_order_relaxed);
    retired_.cache_hits += counts->hits.exchange(0, std::memory_order_relaxed);
    free_.push_back(counts);
  }
  CastCounts sum() {
    std::lock_guard<std::mutex> lock(mutex_);
    CastCounts total = retired_;
    for (const auto& counts : slots_) {
      total.casts += counts->casts.load(std::memory_order_relaxed);
      total.cache_hits += counts->hits.load(std::memory_order_relaxed);
    }
    return total;
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<ThreadCounts>> slots_;
  std::vector<ThreadCounts*> free_;
  CastCounts retired_;
};

CountRegistry& count_registry() {
  static auto* r = new CountRegistry();  // leaked: threads may end during static destruction
  return *r;
}

// A plain pointer, so reading it needs no thread_local initialisation check
// on every cast; the object with a destructor is touched once per thread.
thread_local ThreadCounts* t_counts = nullptr;
thread_local bool t_exited = false;

struct RetireAtThreadExit {
  ThreadCounts* counts = nullptr;
  ~RetireAtThreadExit() {
    t_exited = true;
    t_counts = nullptr;
    count_registry().retire(counts);
  }
};

// Out of line, so the hot path stays a load, a test and an add.
C10_NOINLINE ThreadCounts* enlist_this_thread() {
  t_counts = count_registry().enlist();
  // A cast made by another thread_local's destructor after ours ran keeps
  // its slot for good rather than revive a destroyed object.
  if (!t_exited) {
    static thread_local RetireAtThreadExit retire;
    retire.counts = t_counts;
  }
  return t_counts;
}

ThreadCounts& thread_counts() {
  ThreadCounts* counts = t_counts;
  return C10_LIKELY(counts != nullptr) ? *counts : *enlist_this_thread();
}

void count(std::atomic<int64_t> ThreadCounts::*counter) {
  std::atomic<int64_t>& c = thread_counts().*counter;
  c.store(c.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

struct Key {
  const c10::TensorImpl* weight;
  at::ScalarType to;
  bool operator==(const Key& other) const { return weight == other.weight && to == other.to; }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    return std::hash<const void*>()(k.weight) ^ (static_cast<size_t>(k.to) << 1);
  }
};

// `copy` - a weight's cast, or its transpose's where `transposed` - in the
// form asked for.
at::Tensor in_form(const at::Tensor& copy, bool transposed, bool transpose) {
  return transposed == transpose ? copy : copy.t();
}

struct Entry {
  // Keeps the weight's TensorImpl allocated, so its address (the key) cannot
  // be reused by another tensor while the entry lives.
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> weight;
  at::Tensor copy;  // the weight's cast, or its transpose's (`transposed`)
  int64_t weight_version;  // the weight's version counter when copied
  bool transposed = false;
};

// ServeCopies: the copies a rerun meets instead of the cache's, by key.
struct ServedCopy {
  at::Tensor weight, served;
  bool transposed;  // `served` stands for the weight's transpose's cast
};
using Served = ska::flat_hash_map<Key, ServedCopy, KeyHash>;
thread_local const Served* t_served = nullptr;

class CastCache {
 public:
  // The cast of weight `t`; of its transpose `view` (weight.t()) where
  // `view` is given. A cast is made once an iteration per weight, of what
  // was asked first - the transpose itself as one op, as native autocast
  // casts nn::Linear's weight.t() - and the other form is its transpose.
  at::Tensor get_or_cast(const at::Tensor& t, at::ScalarType to, const at::Tensor* view = nullptr) {
    const Key key{t.unsafeGetTensorImpl(), to};
    const bool transpose = view != nullptr;
    if (C10_UNLIKELY(t_served != nullptr)) {
      if (auto it = t_served->find(key); it != t_served->end()) {
        return in_form(it->second.served, it->second.transposed, transpose);
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = entries_.find(key);
      if (it != entries_.end() && is_fresh(it->second, t)) {
        count(&ThreadCounts::hits);
        CallRecord::note_cache_hit();
        return in_form(it->second.copy, it->second.transposed, transpose);
      }
    }
    at::Tensor copy;
    {
      AMP_TRACE_RANGE("amp::cast (cached weight)", t);
      copy = (transpose ? *view : t).to(to);  // outside the lock: casts of other weights run in parallel
    }
    count(&ThreadCounts::casts);
    CallRecord::note_cast(copy);
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.insert_or_assign(key, Entry{c10::weak_intrusive_ptr<c10::TensorImpl,
                                                                 c10::UndefinedTensorImpl>(
                                             t.getIntrusivePtr()),
                                         copy, t._version(), transpose});
    return copy;
  }

  void clear() {
    // Reused from clear to clear on each thread: no allocation an iteration.
    thread_local std::vector<Entry> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dropped.reserve(entries_.size());
      for (auto& [key, entry] : entries_) dropped.push_back(std::move(entry));
      entries_.clear();  // keeps its buckets: the next iteration inserts as many again
    }
    dropped.clear();  // the copies are freed outside the lock
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.size();
  }

  // What casts on this thread meet: the entries, or what ServeCopies serves.
  std::vector<CachedCopy> copies() {
    std::vector<CachedCopy> out;
    if (t_served != nullptr) {
      for (const auto& [key, copy] : *t_served) out.push_back({copy.weight, key.to, copy.served, copy.transposed});
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [key, entry] : entries_) {
      if (t_served != nullptr && t_served->count(key)) continue;
      at::Tensor weight(entry.weight.lock());
      if (weight.defined()) out.push_back({std::move(weight), key.to, entry.copy, entry.transposed});
    }
    return out;
  }

 private:
  static bool is_fresh(const Entry& e, const at::Tensor& t) {
    if (e.weight_version != t._version()) return false;  // edited in place since the cast
    // A copy made under no_grad has no history; reusing it with grad on
    // would silently cut the weight out of the graph.
    return e.copy.requires_grad() || !at::GradMode::is_enabled();
  }

  std::mutex mutex_;
  ska::flat_hash_map<Key, Entry, KeyHash> entries_;
};

CastCache& cache() {
  static CastCache* c = new CastCache();  // leaked: tensors may die during static destruction
  return *c;
}

}  // namespace

namespace {

bool is_weight(const at::TensorBase& t) { return t.requires_grad() && t.is_leaf() && !t.is_view(); }

// A view of a contiguous weight, such as the weight.t() that LibTorch's
// nn::Linear passes to addmm: served as the same view of the weight's cached
// copy, so the weight itself is still cast once.
bool is_view_of_weight(const at::Tensor& t) {
  return t.is_view() && is_weight(t._base()) && t._base().is_contiguous();
}

}  // namespace

// Not under InferenceMode, nor in a disable_cast_cache region (LibTorch's
// thread-local autocast cache switch, as torch.autocast(cache_enabled=False)).
bool is_cacheable(const at::Tensor& t, at::ScalarType to) {
  // Without autograd metadata a tensor is neither a weight nor a view (views
  // always carry it): a pointer read instead of two calls through autograd.
  return internal::is_low_precision(to) && t.scalar_type() == at::kFloat &&
         t.unsafeGetTensorImpl()->autograd_meta() != nullptr && (is_weight(t) || is_view_of_weight(t)) &&
         !c10::InferenceMode::is_enabled() && at::autocast::is_autocast_cache_enabled();
}

// Whether `view` is `base` (2-D) transposed: weight.t(), as nn::Linear
// passes it to addmm.
bool is_transpose_of(const at::Tensor& view, const at::TensorBase& base) {
  return base.dim() == 2 && view.dim() == 2 && view.storage_offset() == base.storage_offset() &&
         view.sizes()[0] == base.sizes()[1] && view.sizes()[1] == base.sizes()[0] &&
         view.strides()[0] == base.strides()[1] && view.strides()[1] == base.strides()[0];
}

at::Tensor cached_cast(const at::Tensor& t, at::ScalarType to) {
  if (!t.is_view()) return cache().get_or_cast(t, to);
  const at::Tensor base(t._base());
  // The transpose as a transpose: its backward transposes the gradient back,
  // where as_strided's zero-fills a tensor of the weight's size and scatters
  // into it (a fill and a copy per weight and backward, the kernels included).
  if (is_transpose_of(t, base)) return cache().get_or_cast(base, to, &t);
  const at::Tensor copy = cache().get_or_cast(base, to);  // contiguous, like its base
  return copy.as_strided(t.sizes(), t.strides(), t.storage_offset() - base.storage_offset());
}

at::Tensor cast_uncached_or_cached(const at::Tensor& t, at::ScalarType to) {
  if (is_cacheable(t, to)) return cached_cast(t, to);
  at::Tensor copy;
  {
    std::optional<TraceRange> range;
    if (C10_UNLIKELY(tracing())) range.emplace("amp::cast", t);
    copy = t.to(to);
  }
  count(&ThreadCounts::casts);
  CallRecord::note_cast(copy);
  return copy;
}

std::vector<CachedCopy> cached_copies() { return cache().copies(); }

ServeCopies::ServeCopies(const std::vector<CachedCopy>& copies, const std::vector<at::Tensor>& served) {
  TORCH_INTERNAL_ASSERT(t_served == nullptr, "amp: ServeCopies scopes do not nest");
  auto map = std::make_unique<Served>();
  for (size_t i = 0; i < copies.size(); ++i) {
    map->emplace(Key{copies[i].weight.unsafeGetTensorImpl(), copies[i].to},
                 ServedCopy{copies[i].weight, served[i], copies[i].transposed});
  }
  t_served = map.release();
}

ServeCopies::~ServeCopies() {
  delete t_served;
  t_served = nullptr;
}

}  // namespace detail

CastCounts cast_counts() { return detail::count_registry().sum(); }

void clear_cast_cache() {
  detail::cache().clear();
  // Autocast kernels amp does not replace (other libraries' own, such as
  // torchvision's) cache their casts in LibTorch's cache.
  at::autocast::clear_cache();
}

size_t cast_cache_size() { return detail::cache().size(); }

}  // namespace amp
