// SPDX-License-Identifier: BSD-3-Clause
#include "model/model_weights.h"
#include <amp/internal/level_rules.h>

#include "support/log.h"
#include "support/trace_range.h"

#include <amp/opt_levels.h>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Operators.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <utility>

namespace amp::detail {
namespace {

std::string describe(const ModelWeights::Entry& e) {
  return std::string(e.is_buffer ? "buffer '" : "parameter '") + e.name + "'";
}

// One fused copy per device.
void copy_all(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  std::map<std::pair<int, int>, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> by_device;
  for (size_t i = 0; i < dst.size(); ++i) {
    const c10::Device device = dst[i].device();
    auto& [d, s] = by_device[{static_cast<int>(device.type()), device.index()}];
    d.push_back(dst[i]);
    s.push_back(src[i]);
  }
  for (auto& [device, lists] : by_device) at::_foreach_copy_(lists.first, lists.second);
}

}  // namespace

// LibTorch's InputArchive gives a tensor the storage (and sizes, strides,
// offset) of the tensor it read, keeping its own dtype: read in the dtype
// that fills the storage exactly.
at::Tensor foreign_float32_values(const at::Tensor& t) {
  if (t.element_size() != 2) return {};
  const size_t as_fp32 = at::detail::computeStorageNbytes(t.sizes(), t.strides(), 4,
                                                          t.storage_offset());
  if (t.storage().nbytes() < as_fp32) return {};
  at::Tensor fp32 = at::empty({0}, t.options().dtype(at::kFloat));
  fp32.set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
  return fp32;
}

ModelWeights::ModelWeights(Mode mode, std::vector<Entry> entries, size_t models)
    : mode_(mode), entries_(std::move(entries)), resting_(models, true) {
  for (size_t i = 0; i < entries_.size(); ++i) {
    Entry& e = entries_[i];
    index_[e.tensor.unsafeGetTensorImpl()] = i;
    e.storage = e.tensor.storage().unsafeGetStorageImpl();
  }
  pending_.store(mode_ != Mode::kNone && !entries_.empty());
}

void ModelWeights::update_pending() {
  bool any = false;
  for (bool r : resting_) any = any || r;
  pending_.store(any);
}

// Masters: the `models` that rest enter computing. Errors (nothing
// changes): a weight that is no longer float32 at rest.
void ModelWeights::enter_compute(const std::vector<bool>& models) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto entering = [&](const Entry& e) { return models[e.model] && resting_[e.model]; };
  for (const Entry& e : entries_) {
    if (!entering(e)) continue;
    TORCH_CHECK(e.tensor.scalar_type() == at::kFloat, "amp: ", describe(e), " is ",
                e.tensor.scalar_type(), " between iterations, but with master weights amp keeps "
                "it in float32 and lowers it to ", e.low, " only for forward and backward. "
                "Something converted it after amp::initialize (model->to(", e.tensor.scalar_type(),
                ")?); keep the model in float32 and let amp lower it.");
  }
  AMP_TRACE_RANGE("amp::weights to the low dtype");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> dst, src;
  for (Entry& e : entries_) {
    if (!entering(e)) continue;
    e.rest = e.tensor.variable_data();  // the float32 data it holds now, whoever wrote it
    if (!e.compute.defined() || e.compute.sizes() != e.rest.sizes() ||
        e.compute.device() != e.rest.device()) {
      e.compute = at::empty_like(e.rest, e.rest.options().dtype(e.low), at::MemoryFormat::Preserve);
    }
    dst.push_back(e.compute);
    src.push_back(e.rest);
  }
  copy_all(dst, src);
  const Entry* read_at_rest = nullptr;  // a weight with a live graph recorded while it rested
  for (Entry& e : entries_) {
    if (!entering(e)) continue;
    if (!read_at_rest && !e.is_buffer && torch::autograd::impl::try_get_grad_accumulator(e.tensor)) {
      read_at_rest = &e;
    }
    e.tensor.set_data(e.compute);  // a new dtype: autograd gives it a new gradient accumulator
    e.version = e.tensor._version();
  }
  for (size_t m = 0; m < models.size(); ++m) resting_[m] = resting_[m] && !models[m];
  update_pending();
  if (read_at_rest != nullptr && !warned_read_at_rest_) {
    warned_read_at_rest_ = true;
    warn("weight_read_in_float32",
         describe(*read_at_rest) + " was read by an op amp does not intercept (x * w, w.pow(2).sum()) with "
             "gradients on while it rested in float32 - before the forward's first view, indexed read or cast "
             "op, or in a forward that has none - and that graph is still alive as the weight enters " +
             c10::toString(read_at_rest->low) + ": if it joins the loss, the weight's gradient comes through "
             "float32, and the bits depend on where the op ran. In forward read weights through ops amp "
             "intercepts (a view or at::linear counts); compute logged values under torch::NoGradGuard, and "
             "penalties after the forward's first op.");
  }
}

void ModelWeights::finish_backward() noexcept {
  if (mode_ == Mode::kConverted) pending_.store(true);  // check again before the next forward
  if (mode_ != Mode::kMasters) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::all_of(resting_.begin(), resting_.end(), [](bool r) { return r; })) return;  // at rest already
  AMP_TRACE_RANGE("amp::weights to float32 masters");
  try {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> dst, src;
    for (const Entry& e : entries_) {
      if (!e.is_buffer || resting_[e.model]) continue;
      dst.push_back(e.rest);
      src.push_back(e.compute);
    }
    copy_all(dst, src);
  } catch (const std::exception& e) {
    log_error(std::string("copying buffers back to float32 failed: ") + e.what());
  }
  for (Entry& e : entries_) {
    if (resting_[e.model]) continue;
    e.tensor.set_data(e.rest);
    e.rest = at::Tensor();
    e.compute = at::Tensor();  // freed unless a live graph saved it; entering allocates anew
  }
  resting_.assign(resting_.size(), true);
  pending_.store(!entries_.empty());
}

void ModelWeights::enter_forward() {
  if (!pending()) return;
  if (mode_ == Mode::kConverted) {
    if (sharded_ != nullptr) sharded_->sync();  // gathers what is stale, takes writes behind amp's back
    check_converted();
    return;
  }
  if (!at::GradMode::is_enabled()) return;
  enter_compute(std::vector<bool>(resting_.size(), true));
}

size_t ModelWeights::begin_block(size_t rerun_of) {
  return mode_ == Mode::kConverted && sharded_ != nullptr ? sharded_->begin_block(rerun_of) : 0;
}

void ModelWeights::end_block() noexcept {
  if (mode_ == Mode::kConverted && sharded_ != nullptr) sharded_->end_block();
}

void ModelWeights::prepare_backward() {
  if (mode_ == Mode::kConverted && sharded_ != nullptr) {
    sharded_->take_member_gradients();
    sharded_->sync();
  }
  if (mode_ == Mode::kConverted) check_converted();
  if (mode_ != Mode::kMasters) return;
  enter_compute(std::vector<bool>(resting_.size(), true));
  std::lock_guard<std::mutex> lock(mutex_);
  check_computing();
}

void ModelWeights::check_computing() {
  for (Entry& e : entries_) {
    const at::Tensor& grad = e.tensor.grad();
    TORCH_CHECK(e.is_buffer || !grad.defined() || grad.scalar_type() == at::kFloat, "amp: ",
                describe(e), " has a ", grad.scalar_type(), " gradient: a backward ran outside "
                "amp::scale_loss, whose guard gives master weights float32 gradients. Wrap "
                "backward in amp::scale_loss(loss, optimizer).");
  }
  at::NoGradGuard no_grad;
  for (Entry& e : entries_) {
    const at::Tensor& t = e.tensor;
    if (!t.storage().is_alias_of(e.compute.storage())) {  // replaced: torch::load, set_
      at::Tensor fp32 = foreign_float32_values(t);
      e.rest = fp32.defined() ? fp32 : t.detach().to(at::kFloat);
      e.compute.copy_(e.rest);
      e.tensor.set_data(e.compute);
    } else if (!e.is_buffer && t._version() != e.version) {  // written in place
      e.rest.copy_(e.compute);
      if (!warned_) {
        warned_ = true;
        warn("master_rebuilt_from_low_precision",
             describe(e) + " was changed while amp held it in " + c10::toString(e.low) +
                 " for forward and backward (a step or an edit after a forward that recorded a "
                 "graph and before its scale_loss guard?); its float32 master was rebuilt from "
                 "the " + c10::toString(e.low) + " values. Run such code under "
                 "torch::NoGradGuard, or after the guard.");
      }
    }
    e.version = t._version();
  }
}

void ModelWeights::check_converted() {
  at::NoGradGuard no_grad;
  for (Entry& e : entries_) {
    const void* storage = e.tensor.storage().unsafeGetStorageImpl();
    if (storage == e.storage) continue;
    if (at::Tensor fp32 = foreign_float32_values(e.tensor); fp32.defined()) {
      e.tensor.set_data(fp32.to(e.low));
    }
    e.storage = e.tensor.storage().unsafeGetStorageImpl();
  }
  pending_.store(sharded_ != nullptr && sharded_->stale());  // weights freed between uses (ZeRO-3) stay pending
}

const ModelWeights::Entry* ModelWeights::find(const c10::TensorImpl* t) const {
  auto it = index_.find(t);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

bool ModelWeights::load_into(at::Tensor& self, const at::Tensor& source) {
  Entry* e = find(self);
  if (e == nullptr || !source.defined() || source.device() != self.device()) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  at::NoGradGuard no_grad;
  if (mode_ == Mode::kConverted) {
    at::_ops::set__source_Tensor::call(self, source.to(e->low));
    e->storage = self.storage().unsafeGetStorageImpl();
    if (sharded_ != nullptr) sharded_->take_values(self, source.to(at::kFloat));
    return true;
  }
  const at::Tensor fp32 = source.to(at::kFloat);
  if (resting_[e->model]) {
    at::_ops::set__source_Tensor::call(self, fp32);
    return true;
  }
  // Computing: the master takes the values; the low-precision copy follows.
  e->rest = fp32;
  if (e->compute.sizes() != fp32.sizes()) {
    e->compute = at::empty_like(fp32, fp32.options().dtype(e->low), at::MemoryFormat::Preserve);
    self.set_data(e->compute);
  }
  e->compute.copy_(fp32);
  self.unsafeGetTensorImpl()->bump_version();  // as set_ would: graphs that saved it are stale
  e->version = self._version();
  return true;
}

at::Tensor ModelWeights::fp32_value(const at::Tensor& t) const {
  if (const Entry* e = find(t); e != nullptr && mode_ == Mode::kMasters && e->rest.defined()) {
    return e->rest.detach();
  }
  return internal::is_low_precision(t.scalar_type()) ? t.detach().to(at::kFloat) : t.detach();
}

}  // namespace amp::detail
