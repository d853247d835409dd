// SPDX-License-Identifier: BSD-3-Clause
// Private: the forward half of overflow provenance (Options::overflow_provenance).
//
// While it is on, every op that runs under amp's keys with gradients enabled
// and outside backward records, on the device, the largest magnitude (a
// foreach inf-norm) of the floating tensors it read and of those it
// returned. Intercepted ops record from their own kernels; every other aten
// op that returns new values gets a watch-only kernel at the same key. The
// records wait in the ForwardLog until a scale_loss guard claims those of
// its loss (step/overflow_provenance.h); the host reads them only when that
// guard's verdict already says overflow.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace amp::detail {

struct DeviceCasting;

struct ForwardRecord {
  // The kernel's display name ("aten::linear"); kernels outlive the log's
  // readers, which need a live context.
  const std::string* op = nullptr;
  std::weak_ptr<torch::autograd::Node> node;  // grad_fn of its first floating output
  bool has_node = false;  // false: that output needs no gradient
  c10::ScalarType dtype = c10::kFloat;        // of that output
  // The module its node was nearest to, when the record outlived that node
  // (a recomputed block's forward; recompute.h); else found from `node`.
  std::optional<std::string> module;
  std::vector<at::Tensor> read_amax, returned_amax;  // 0-dim, on the tensors' devices
};

class ForwardLog {
 public:
  // At most this many records wait; older ones are dropped first (a long
  // run of forwards with gradients on and no guard, e.g. an evaluation
  // loop without torch::NoGradGuard).
  static constexpr size_t kCapacity = size_t{1} << 16;

  void add(ForwardRecord record);
  // Takes, in the order the ops ran, the records whose node `in_graph`
  // accepts and those without a node (ops on tensors that need no
  // gradient); records whose graph is gone are dropped, others stay.
  std::vector<ForwardRecord> claim(const std::function<bool(const torch::autograd::Node*)>& in_graph);
  void clear();
  // Lets `edit` change every waiting record.
  void edit(const std::function<void(ForwardRecord&)>& edit);

 private:
  std::mutex mutex_;  // forwards may run on several threads (enable_casts)
  std::deque<ForwardRecord> records_;
};

// Observes one call of `op`. Inactive (nothing recorded) without a log,
// with gradients disabled (optimizer steps, evaluation) or in backward,
// which the backward hooks cover.
class ForwardWatch {
 public:
  ForwardWatch(ForwardLog* log, const std::string& op);
  bool active() const { return log_ != nullptr; }
  void read(const std::vector<at::Tensor>& tensors);  // before the call
  void returned(const std::vector<at::Tensor>& tensors);  // after it: adds the record

 private:
  ForwardLog* log_;
  ForwardRecord record_;
};

// The largest magnitude of each tensor of `tensors` that can hold inf/NaN
// (floating or complex, not empty), as 0-dim tensors computed on its device
// by one foreach call, with gradients off. Nothing is read to the host.
std::vector<at::Tensor> amax_each(at::TensorList tensors);

// The tensors a kernel's view (TypedArgs, BoxedArgs) or result holds.
template <class View>
std::vector<at::Tensor> tensors_of(const View& view) {
  std::vector<at::Tensor> out;
  view.for_each_tensor([&](const at::Tensor& t, bool) { out.push_back(t); });
  return out;
}

// Registers the watch-only kernel at `casting`'s key, in `library` (aten),
// for every aten op that returns new tensor values and has no kernel there
// yet (those with one are amp's own bindings, which watch themselves).
void watch_other_ops(torch::Library& library, const DeviceCasting& casting);

}  // namespace amp::detail
