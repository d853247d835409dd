// SPDX-License-Identifier: BSD-3-Clause
#include "distributed/gather_rendezvous.h"

#ifdef AMP_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace amp::detail {
namespace {

constexpr const char* kGo = "go";
constexpr const char* kCalledOff = "off";

c10::intrusive_ptr<c10d::Store> store_of(const c10::intrusive_ptr<c10d::Backend>& group) {
#ifdef AMP_WITH_GLOO
  if (auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(group.get())) {
    // A ProcessGroupGloo wraps its store in a GlooStore, always (a
    // dynamic_cast would need gloo's type information, which LibTorch
    // does not export).
    if (const auto& store = gloo->_getStore()) {
      return static_cast<c10d::ProcessGroupGloo::GlooStore*>(store.get())->_getStore();
    }
  }
#endif
  return {};
}

}  // namespace

GatherRendezvous::GatherRendezvous(const c10::intrusive_ptr<c10d::Backend>& group,
                                   c10::intrusive_ptr<c10d::Store> store, std::string name)
    : store_(store ? std::move(store) : store_of(group)),
      prefix_("amp/gather/" + std::move(name) + "/"),
      world_(group->getSize()) {}

bool GatherRendezvous::meet(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const uint64_t r = round_++;
    const std::string verdict = key(r, "verdict");
    if (store_->add(key(r, "arrived"), 1) == world_ && store_->compareSet(verdict, "", kGo) == kGo && r > 0) {
      // Every rank came to this round, so every rank is done with the one before.
      store_->deleteKey(key(r - 1, "arrived"));
      store_->deleteKey(key(r - 1, "verdict"));
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    bool decided = true;
    try {
      store_->wait({verdict}, std::max(left, std::chrono::milliseconds(1)));
    } catch (const c10::Error&) {  // timed out (FileStore raises a plain c10::Error)
      decided = false;
    }
    if (!decided) return store_->compareSet(verdict, "", kCalledOff) == kGo;  // the last rank may just have come
    if (store_->get_to_str(verdict) == kGo) return true;
    // Another rank called this round off before this one came: meet at the next.
  }
}

std::string GatherRendezvous::key(uint64_t round, const char* what) const {
  return prefix_ + std::to_string(round) + "/" + what;
}

std::chrono::milliseconds gather_wait(std::chrono::milliseconds gather_timeout,
                                      const c10::intrusive_ptr<c10d::Backend>& group,
                                      std::chrono::milliseconds* group_timeout) {
  *group_timeout = std::chrono::milliseconds(0);
  try {
    *group_timeout = group->getBackendOptions()->timeout;
  } catch (const c10::Error&) {  // a backend without options: gather_timeout alone
    return gather_timeout;
  }
  return group_timeout->count() > 0 ? std::min(gather_timeout, *group_timeout / 2) : gather_timeout;
}

}  // namespace amp::detail
