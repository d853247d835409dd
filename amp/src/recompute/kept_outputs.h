// SPDX-License-Identifier: BSD-3-Clause
// Private: what a recomputed block keeps of its forward for its rerun
// (amp::Keep, selective_recompute.h), and the dispatcher kernel that keeps and serves
// it.
//
// The kernel sits at the ADInplaceOrView key of each op a Keep names: below
// autograd, above the backends. Autograd's kernel records the op's node as
// always and calls down to it. In a block's forward it runs the op and holds
// on to its outputs' values (new tensors sharing their storage, so nothing
// of forward's graph stays alive); in the rerun it returns those values
// without running the op, and autograd builds the same node around the
// values forward computed. Every call of a named op inside the block is an
// entry, kept or not, in order, so the rerun meets them in the same order
// and knows which to compute.
#pragma once

#include <amp/recompute.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/operator_name.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstdint>
#include <functional>
#include <unordered_set>
#include <vector>

namespace amp::detail {

// The ops `names` name, checked to be keepable (selective_recompute.h); throws
// c10::Error naming the first that is not, and what to name instead.
std::vector<c10::OperatorName> keepable_ops(const std::vector<std::string>& names);

class KeptOutputs {
 public:
  // Registers the kernel for `keep`'s ops (once per op in the process).
  explicit KeptOutputs(const internal::KeptOps& keep);

  // RAII: this thread's calls of the kept ops are recorded into `kept` (a
  // block's forward), or served from it (its rerun); with `kept` null,
  // neither (a block that keeps nothing: the calls inside it are its own,
  // not those of an enclosing block's).
  class [[nodiscard]] Scope {
   public:
    enum class Mode { kRecord, kServe };
    Scope(KeptOutputs* kept, Mode mode);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

    // This thread's innermost scope, or null.
    static const Scope* current();
    KeptOutputs* kept() const { return kept_; }
    Mode mode() const { return mode_; }

   private:
    KeptOutputs* kept_;
    Mode mode_;
    const Scope* previous_;
  };

  // After the forward: outputs the block changed in place after their op
  // returned are not kept (the rerun computes those calls).
  void settle();
  // After a rerun: it made every call forward made (else throws).
  void check_all_served() const;
  // The bytes of the outputs kept.
  int64_t kept_bytes() const;

  // The kernel's work (kept_outputs.cpp).
  bool watches(const c10::OperatorName& op) const { return watched_.count(op) > 0; }
  void record(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack);
  void serve(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack);

 private:
  struct Entry {
    c10::OperatorName op;
    bool kept = false;
    std::vector<c10::IValue> outputs;  // tensors: the values, without autograd
    std::vector<std::pair<c10::VariableVersion, uint32_t>> versions;  // the outputs' counters when returned
  };

  std::unordered_set<c10::OperatorName> watched_;
  std::function<bool(const std::string&, const std::vector<at::Tensor>&)> when_;
  std::vector<Entry> entries_;
  size_t served_ = 0;  // entries the current rerun met
};

}  // namespace amp::detail
