// Private: data-parallel gradient averaging (Options::data_parallel), the
// bucketed all-reduce a scale_loss guard runs over its parameters.
//
// A layout groups the guard's parameters into buckets in reverse order (the
// order backward produces gradients). Each bucket is one flat tensor in the
// reduce dtype: the gradients, then one "used" flag per parameter. Layouts
// are kept per set of parameters, so a GAN's alternating guards reuse
// theirs, and rebuilt when an optimizer's parameters change.
//
// One guard's reduction (Reduction) hooks the parameters' gradient
// accumulators. When backward has produced every gradient of a bucket, the
// bucket is filled and, if every earlier bucket has started, its all-reduce
// starts - in bucket order, so the ranks' collectives match. finish()
// starts what backward left (parameters without a gradient count zero),
// waits, and installs the averages as the parameters' .grad (new tensors:
// the buckets are reused by the next guard).
#pragma once

#include "step/unscale_plan.h"

#include <amp/distributed.h>

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace amp::detail {

class GradientReducer {
 public:
  explicit GradientReducer(DataParallel config);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  class Reduction;
  // Starts one guard's reduction over `slots` (which must outlive it): hooks
  // the gradient accumulators backward will run. Waits for reductions an
  // unwound guard left running on the same buckets.
  std::unique_ptr<Reduction> start(std::vector<GradSlot>& slots);

 private:
  struct Layout;
  DataParallel config_;
  int world_;
  std::map<std::vector<const void*>, std::unique_ptr<Layout>> layouts_;
};

class GradientReducer::Reduction {
 public:
  Reduction(GradientReducer& reducer, Layout& layout, std::vector<GradSlot>& slots);
  // Unhooks; reductions already started are waited for by the next start().
  ~Reduction();
  Reduction(const Reduction&) = delete;
  Reduction& operator=(const Reduction&) = delete;

  // Starts every remaining bucket, waits for all, and installs the averages.
  // Slots with a scaled aside (an accumulation's earlier micro-batches) have
  // it reduced with their fresh gradient and marked aside_reduced. Errors:
  // see distributed.h.
  void finish();

 private:
  void on_gradient(size_t slot);
  void fill(size_t bucket);
  void start_ready_buckets();
  void unhook() noexcept;

  GradientReducer& reducer_;
  Layout& layout_;
  std::vector<GradSlot>& slots_;
  std::mutex mutex_;  // hooks run on autograd's threads
  std::vector<bool> produced_;          // per slot: its accumulator ran
  std::vector<int64_t> missing_;        // per bucket: slots not produced yet
  size_t next_bucket_ = 0;              // buckets before it have started
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
  std::string error_;                   // met inside a hook, raised by finish()
};

}  // namespace amp::detail
