// Private: what one scale_loss guard records, on the device, to say where an
// overflow came from (amp/overflow.h), and the report built from it.
//
// Recording never reads the device. Each backward node of the guarded loss
// gets a post hook that stacks the largest magnitude (a foreach inf-norm)
// of the gradients it received and of those it produced; the guard adds the
// largest magnitude of every gradient it unscaled. Only when the verdict
// says overflow does report() read them, in one copy.
#pragma once

#include <amp/overflow.h>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace amp::detail {

// Parameter names of initialize's models ("fc1.weight"; "model1.fc1.weight"
// with several models), by tensor.
using ParameterNames = std::unordered_map<const c10::TensorImpl*, std::string>;

class ProvenanceTrace {
 public:
  // Hooks every node of `scaled_loss`'s graph (nodes hooked by an earlier
  // trace record into the newest one).
  static std::shared_ptr<ProvenanceTrace> watch(const at::Tensor& scaled_loss,
                                                std::shared_ptr<const ParameterNames> names);

  // The unscaled gradients of `params` (same order), checked by the guard.
  void record_gradients(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads);

  // Reads what was recorded (one host sync) and names the first node that
  // turned finite gradients into inf/NaN and the gradients that hold one.
  OverflowReport report(int loss_id, double loss_scale) const;

  // Called by a node's hook as backward runs it.
  void record_node(const std::string& op, const std::string& module, const at::TensorList received,
                   const at::TensorList produced);

 private:
  explicit ProvenanceTrace(std::shared_ptr<const ParameterNames> names) : names_(std::move(names)) {}

  struct NodeRecord {
    std::string op, module;
    c10::ScalarType dtype;
    at::Tensor received_amax, produced_amax;  // 0-dim float32 on the device
  };
  std::shared_ptr<const ParameterNames> names_;
  mutable std::mutex mutex_;  // backward runs nodes on device threads
  std::vector<NodeRecord> nodes_;   // in the order backward ran them
  std::vector<const c10::TensorImpl*> grad_params_;
  at::Tensor grad_amax_;  // [params] float32
};

}  // namespace amp::detail
