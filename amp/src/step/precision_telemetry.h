// SPDX-License-Identifier: BSD-3-Clause
// Private: the device-side records behind amp/telemetry.h, one recorder per
// live context, joining each guard as a step participant. Recording enqueues kernels and keeps their results; only
// the public readers copy them to the host.
#pragma once

#include <amp/telemetry.h>

#include "step/overflow_provenance.h"
#include "step/step_participant.h"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace amp::detail {

// A step participant: each guard records what it unscaled.
class TelemetryParticipant final : public StepParticipant {
 public:
  static constexpr size_t kHistory = 10000;  // scales kept per loss

  // `low_dtype`: the low-precision dtype of a device type.
  TelemetryParticipant(int num_losses, std::shared_ptr<const ParameterNames> names,
                    std::function<c10::ScalarType(c10::DeviceType)> low_dtype);

  // A guard of `loss_id` unscaled the gradients of `optimizers`; its
  // backward ran at `scale` (1 element, on the loss's device).
  void record(int loss_id, const at::Tensor& scale, const std::vector<torch::optim::Optimizer*>& optimizers);

  std::unique_ptr<GuardPart> open(Guard& guard) override;

  std::optional<PrecisionTelemetry> read(const torch::optim::Optimizer& optimizer) const;
  std::vector<double> scale_history(int loss_id) const;

 private:
  struct Part {  // the gradients of one group on one device
    std::vector<const c10::TensorImpl*> params;
    std::vector<int64_t> numel;
    at::Tensor counts;     // int64 [2, params]: underflow, zeros
    at::Tensor amax;       // float32 [params]
  };
  struct Record {
    int loss_id = 0;
    at::Tensor scale;
    std::vector<std::vector<Part>> groups;
  };
  Part record_part(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const at::Tensor& scale) const;

  std::shared_ptr<const ParameterNames> names_;
  std::function<c10::ScalarType(c10::DeviceType)> low_dtype_;
  mutable std::mutex mutex_;
  std::unordered_map<const torch::optim::Optimizer*, Record> latest_;
  std::vector<std::deque<at::Tensor>> scales_;  // per loss: each guard's scale, a copy
};

}  // namespace amp::detail
