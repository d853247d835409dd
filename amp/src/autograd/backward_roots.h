// SPDX-License-Identifier: BSD-3-Clause
// Private: the roots of the backward passes scale_loss guards are running
// now. The autograd engine tells a node running inside a backward which
// nodes the pass reaches, but not its root; code that must see every edge
// of the graph (early_hand_on.h) takes the root from here.
#pragma once

#include <memory>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace amp::detail {

// Registers `root` (the scaled loss's grad_fn) while the backward from it
// runs. Held on the thread that calls backward; read from any thread (the
// engine runs a device's nodes on that device's thread).
class BackwardFromRoot {
 public:
  explicit BackwardFromRoot(std::shared_ptr<torch::autograd::Node> root);
  ~BackwardFromRoot();
  BackwardFromRoot(const BackwardFromRoot&) = delete;
  BackwardFromRoot& operator=(const BackwardFromRoot&) = delete;

  // The roots of every registered backward running now, on any thread.
  static std::vector<std::shared_ptr<torch::autograd::Node>> running();

 private:
  std::shared_ptr<torch::autograd::Node> root_;
};

}  // namespace amp::detail
