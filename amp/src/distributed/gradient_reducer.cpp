#include "distributed/gradient_reducer.h"

#include "step/host_read.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <utility>

namespace amp::detail {

struct GradientReducer::Layout {
  struct Bucket {
    std::vector<size_t> slots;     // indices into the guard's slots
    std::vector<int64_t> offsets;  // of each slot's gradient in `flat`
    int64_t numel = 0;             // gradient elements; one flag per slot follows
    at::Tensor flat;
    c10::intrusive_ptr<c10d::Work> work;  // started and not yet waited for
  };
  std::vector<int64_t> numels;   // per slot, to see a parameter resized
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;  // per slot; only for slots in a bucket
};

GradientReducer::GradientReducer(DataParallel config)
    : config_(std::move(config)), world_(config_.group->getSize()) {}

GradientReducer::~GradientReducer() = default;

std::unique_ptr<GradientReducer::Reduction> GradientReducer::start(std::vector<GradSlot>& slots) {
  // Parameters that cannot have a gradient (requires_grad false) stay out,
  // so a frozen layer costs nothing; freezing or unfreezing changes the key.
  std::vector<const void*> key;
  std::vector<int64_t> numels;
  for (const GradSlot& s : slots) {
    key.push_back(s.param.requires_grad() ? s.param.unsafeGetTensorImpl() : nullptr);
    numels.push_back(s.param.numel());
  }
  std::unique_ptr<Layout>& layout = layouts_[key];
  if (!layout || layout->numels != numels) {
    layout = std::make_unique<Layout>();
    layout->numels = numels;
    layout->bucket_of.assign(slots.size(), 0);
    const int64_t element = c10::elementSize(config_.reduce_dtype);
    for (size_t i = slots.size(); i-- > 0;) {
      if (key[i] == nullptr) continue;
      if (layout->buckets.empty() || layout->buckets.back().numel * element >= config_.bucket_bytes) {
        layout->buckets.emplace_back();
      }
      Layout::Bucket& bucket = layout->buckets.back();
      layout->bucket_of[i] = layout->buckets.size() - 1;
      bucket.slots.push_back(i);
      bucket.offsets.push_back(bucket.numel);
      bucket.numel += numels[i];
    }
    for (Layout::Bucket& bucket : layout->buckets) {
      const at::Tensor& param = slots[bucket.slots.front()].param;
      bucket.flat = at::zeros({bucket.numel + static_cast<int64_t>(bucket.slots.size())},
                              param.options().dtype(config_.reduce_dtype).requires_grad(false));
    }
  }
  for (Layout::Bucket& bucket : layout->buckets) {
    // An unwound guard's all-reduce may still be running on this buffer.
    if (bucket.work) {
      bucket.work.reset();
      bucket.flat = at::zeros_like(bucket.flat);
    }
  }
  return std::make_unique<Reduction>(*this, *layout, slots);
}

GradientReducer::Reduction::Reduction(GradientReducer& reducer, Layout& layout,
                                      std::vector<GradSlot>& slots)
    : reducer_(reducer), layout_(layout), slots_(slots), produced_(slots.size(), false) {
  for (const Layout::Bucket& bucket : layout_.buckets) missing_.push_back(bucket.slots.size());
  for (const Layout::Bucket& bucket : layout_.buckets) {
    for (size_t s : bucket.slots) {
      // A parameter without an accumulator is in no live graph: backward
      // cannot produce its gradient, and finish() counts it zero.
      std::shared_ptr<torch::autograd::Node> accumulator =
          torch::autograd::impl::try_get_grad_accumulator(slots_[s].param);
      if (!accumulator) continue;
      const uintptr_t key = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, s](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            on_gradient(s);
            return outputs;
          }));
      hooks_.emplace_back(std::move(accumulator), key);
    }
  }
}

GradientReducer::Reduction::~Reduction() { unhook(); }

void GradientReducer::Reduction::unhook() noexcept {
  for (auto& [accumulator, key] : hooks_) accumulator->del_post_hook(key);
  hooks_.clear();
}

void GradientReducer::Reduction::on_gradient(size_t slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (produced_[slot]) {
    if (error_.empty()) {
      error_ = "amp: a parameter's gradient was accumulated twice inside one data-parallel "
               "scale_loss guard (two backward passes through it); its bucket was already being "
               "averaged. Run each backward in its own guard, or accumulate with delay_unscale=true.";
    }
    return;
  }
  produced_[slot] = true;
  --missing_[layout_.bucket_of[slot]];
  start_ready_buckets();
}

// Copies the bucket's gradients in: this backward's, plus an accumulation's
// earlier micro-batches (scaled asides); zero for a parameter without any.
void GradientReducer::Reduction::fill(size_t b) {
  Layout::Bucket& bucket = layout_.buckets[b];
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> dst, src, aside_dst, asides;
  at::Tensor flags = bucket.flat.narrow(0, bucket.numel, static_cast<int64_t>(bucket.slots.size()));
  flags.fill_(1);
  for (size_t j = 0; j < bucket.slots.size(); ++j) {
    const GradSlot& slot = slots_[bucket.slots[j]];
    at::Tensor grad = slot.param.grad();
    if (grad.defined() && grad.is_sparse()) {
      if (error_.empty()) {
        error_ = "amp: data-parallel averaging needs dense gradients, but a parameter's gradient "
                 "is sparse (Embedding with sparse=true?); use sparse=false.";
      }
      grad = at::Tensor();
    }
    at::Tensor region = bucket.flat.narrow(0, bucket.offsets[j], slot.param.numel()).view(slot.param.sizes());
    const at::Tensor aside = slot.aside_scaled ? slot.aside : at::Tensor();
    if (grad.defined()) {
      dst.push_back(region);
      src.push_back(grad);
    } else {
      region.zero_();
      if (!aside.defined()) flags.narrow(0, static_cast<int64_t>(j), 1).zero_();
    }
    if (aside.defined()) {
      aside_dst.push_back(region);
      asides.push_back(aside);
    }
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);
  if (!aside_dst.empty()) at::_foreach_add_(aside_dst, asides);
  // A low-precision sum of world gradients could overflow where their mean
  // does not: divide first (DDP's pre-division).
  if (c10::isReducedFloatingType(bucket.flat.scalar_type())) {
    bucket.flat.narrow(0, 0, bucket.numel).div_(reducer_.world_);
  }
}

void GradientReducer::Reduction::start_ready_buckets() {
  while (next_bucket_ < layout_.buckets.size() && missing_[next_bucket_] == 0) {
    Layout::Bucket& bucket = layout_.buckets[next_bucket_++];
    fill(next_bucket_ - 1);
    std::vector<at::Tensor> tensors{bucket.flat};
    bucket.work = reducer_.config_.group->allreduce(tensors);
  }
}

void GradientReducer::Reduction::finish() {
  unhook();
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t& m : missing_) m = 0;  // what backward did not produce counts zero
  start_ready_buckets();
  for (Layout::Bucket& bucket : layout_.buckets) {
    bucket.work->wait();
    bucket.work.reset();
  }
  TORCH_CHECK(error_.empty(), error_);

  // A parameter this rank has no gradient for keeps none unless another
  // rank had one: only then are the summed flags read (on the host).
  std::vector<at::Tensor> views, unknown_flags;
  std::vector<size_t> order, unknown;
  for (const Layout::Bucket& bucket : layout_.buckets) {
    for (size_t j = 0; j < bucket.slots.size(); ++j) {
      const size_t s = bucket.slots[j];
      views.push_back(bucket.flat.narrow(0, bucket.offsets[j], slots_[s].param.numel())
                          .view(slots_[s].param.sizes()));
      order.push_back(s);
      const bool local = produced_[s] || slots_[s].param.grad().defined() ||
                         (slots_[s].aside_scaled && slots_[s].aside.defined());
      if (!local) {
        unknown.push_back(order.size() - 1);
        unknown_flags.push_back(bucket.flat.narrow(0, bucket.numel + static_cast<int64_t>(j), 1));
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
    GradSlot& slot = slots_[order[i]];
    slot.param.mutable_grad() = std::move(averages[i]);
    slot.aside_reduced = slot.aside_scaled && slot.aside.defined();
  }
}

}  // namespace amp::detail
