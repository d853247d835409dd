// SPDX-License-Identifier: BSD-3-Clause
#include "distributed/weight_residency.h"

#include <algorithm>

namespace amp::detail {

void WeightResidency::take(size_t g) {
  if (owner_[g] == kFreed) ++wholes_;
  owner_[g] = depth();
  read(g);
}

void WeightResidency::read(size_t g) {
  owner_[g] = std::min(owner_[g], depth());
  if (runs_.empty() || runs_.back().rerun || runs_.back().id < first_id_) return;
  std::vector<size_t>& read = blocks_[runs_.back().id - first_id_].read;
  if (std::find(read.begin(), read.end(), g) == read.end()) read.push_back(g);
}

std::vector<size_t> WeightResidency::end_run() {
  std::vector<size_t> freed;
  for (size_t g = 0; g < owner_.size(); ++g) {
    if (owner_[g] == depth()) {
      owner_[g] = kFreed;
      --wholes_;
      freed.push_back(g);
    }
  }
  if (!runs_.empty()) runs_.pop_back();
  return freed;
}

void WeightResidency::end_round() {
  std::fill(owner_.begin(), owner_.end(), kFreed);
  wholes_ = 0;
  first_id_ += blocks_.size();
  blocks_.clear();
}

size_t WeightResidency::begin_run(size_t rerun_of) {
  if (rerun_of != kForward) {
    runs_.push_back({rerun_of, true});
    return rerun_of;
  }
  const size_t id = first_id_ + blocks_.size();
  blocks_.push_back({{}, runs_.empty() ? Run{kFreed, false} : runs_.back()});
  runs_.push_back({id, false});
  return id;
}

bool WeightResidency::in_rerun() const {
  return std::any_of(runs_.begin(), runs_.end(), [](const Run& r) { return r.rerun; });
}

const WeightResidency::Block* WeightResidency::block(size_t id) const {
  return id >= first_id_ && id - first_id_ < blocks_.size() ? &blocks_[id - first_id_] : nullptr;
}

bool WeightResidency::siblings(size_t a, size_t b) const {
  const Block* x = block(a);
  const Block* y = block(b);
  return x && y && x->parent.id == y->parent.id && x->parent.rerun == y->parent.rerun;
}

const std::vector<size_t>& WeightResidency::read_by(size_t id) const {
  static const std::vector<size_t> none;
  const Block* b = block(id);
  return b ? b->read : none;
}

}  // namespace amp::detail
