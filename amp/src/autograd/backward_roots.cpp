// SPDX-License-Identifier: BSD-3-Clause
#include "autograd/backward_roots.h"

#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <mutex>
#include <utility>

namespace amp::detail {
namespace {

struct RootRegistry {
  std::mutex mutex;
  std::vector<std::shared_ptr<torch::autograd::Node>> roots;  // one entry per running backward
};

RootRegistry& root_registry() {
  static RootRegistry r;
  return r;
}

}  // namespace

BackwardFromRoot::BackwardFromRoot(std::shared_ptr<torch::autograd::Node> root) : root_(std::move(root)) {
  if (!root_) return;
  RootRegistry& r = root_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.roots.push_back(root_);
}

BackwardFromRoot::~BackwardFromRoot() {
  if (!root_) return;
  RootRegistry& r = root_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.roots.erase(std::find(r.roots.begin(), r.roots.end(), root_));
}

std::vector<std::shared_ptr<torch::autograd::Node>> BackwardFromRoot::running() {
  RootRegistry& r = root_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.roots;
}

}  // namespace amp::detail
