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
  std::vector<size_t>& read = read_[runs_.back().id - first_id_];
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
  first_id_ += read_.size();
  read_.clear();
  parent_.clear();
}

size_t WeightResidency::begin_run(size_t rerun_of) {
  if (rerun_of != kForward) {
    runs_.push_back({rerun_of, true});
    return rerun_of;
  }
  const size_t id = first_id_ + read_.size();
  read_.emplace_back();
  parent_.push_back(runs_.empty() ? Run{kFreed, false} : runs_.back());
  runs_.push_back({id, false});
  return id;
}

bool WeightResidency::in_rerun() const {
  return std::any_of(runs_.begin(), runs_.end(), [](const Run& r) { return r.rerun; });
}

bool WeightResidency::siblings(size_t a, size_t b) const {
  auto known = [&](size_t id) { return id >= first_id_ && id - first_id_ < parent_.size(); };
  if (!known(a) || !known(b)) return false;
  const Run& x = parent_[a - first_id_];
  const Run& y = parent_[b - first_id_];
  return x.id == y.id && x.rerun == y.rerun;
}

const std::vector<size_t>& WeightResidency::read_by(size_t id) const {
  static const std::vector<size_t> none;
  return id >= first_id_ && id - first_id_ < read_.size() ? read_[id - first_id_] : none;
}

}  // namespace amp::detail
