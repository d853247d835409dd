// SPDX-License-Identifier: BSD-3-Clause
// The oracle: a program in plain LibTorch, float64 (or float32), no amp. It differs from
// a plain loop only where amp's contract says a step behaves differently:
// skipped steps are not taken and their gradients are discarded (with
// LibTorch's own optimizers by the guard that overflowed). With parameters
// stored in the low dtype (O3) each value is rounded to it after each step.
#include "runs.h"
#include "workload.h"

namespace amp::scenarios {
namespace {

void clear_gradients(const torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    for (auto p : group.params()) p.mutable_grad() = at::Tensor();
  }
}

void round_to(const std::vector<at::Tensor>& params, c10::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  for (auto p : params) p.copy_(p.to(dtype));
}

std::vector<at::Tensor> params_of(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) out.push_back(p);
  }
  return out;
}

}  // namespace

Trace run_reference(const Program& p, const LevelRun& run, const Trace& expected, torch::Dtype dtype) {
  Workload w = build_workload(p, dtype, p.seed);
  if (run.low_storage) {
    for (const auto& m : w.models) round_to(m->parameters(), run.compute);
  }
  Trace trace;
  trace.outcomes = expected.outcomes;
  trace.scales = expected.scales;
  {
    std::vector<std::vector<at::Tensor>> params;
    for (const auto& o : w.optimizers) params.push_back(params_of(*o));
    trace.initial = stepped_values(params);
  }
  size_t guard = 0;  // the unscaling guards, in order: expected.discarded
  for (int it = 0; it < p.iterations; ++it) {
    if (p.restart_before == it) {  // a restart keeps parameters and optimizer state, not gradients
      for (const auto& o : w.optimizers) clear_gradients(*o);
    }
    for (int ph = 0; ph < static_cast<int>(p.phases.size()); ++ph) {
      const Phase& phase = p.phases[ph];
      zero_gradients(p, phase, w.models, w.optimizers);
      const bool throws = p.exception && p.exception->iteration == it && p.exception->phase == ph;
      for (int l = 0; l < static_cast<int>(phase.losses.size()); ++l) {
        const LossSpec& loss = phase.losses[l];
        for (int mb = 0; mb < phase.micro_batches; ++mb) {
          const bool last = l + 1 == static_cast<int>(phase.losses.size()) && mb + 1 == phase.micro_batches;
          if (throws && last) continue;  // the guard that threw leaves no gradients behind
          at::Tensor value = loss_forward(w, loss, batch_for(p, it, ph, l, mb), dtype);
          if (loss.penalty > 0) {
            const auto params = w.models[penalty_model(loss)]->parameters();
            const auto grads = torch::autograd::grad({value}, params, {}, true, true, true);
            for (const auto& g : grads) {
              if (g.defined()) value = value + loss.penalty * g.pow(2).sum();
            }
          }
          value.backward();
          if (loss.clip && mb + 1 == phase.micro_batches) {
            std::vector<at::Tensor> params;
            for (int o : loss.guard) {
              for (const auto& t : params_of(*w.optimizers[o])) params.push_back(t);
            }
            torch::nn::utils::clip_grad_norm_(params, *loss.clip);
          }
          if (mb + 1 == phase.micro_batches) {
            for (int o : expected.discarded.at(guard)) clear_gradients(*w.optimizers[o]);
            ++guard;
          }
        }
      }
      for (int o : phase.steps) {
        const int64_t outcome = expected.outcomes[it][o];
        if (outcome == kStepped) w.optimizers[o]->step();
        if (run.low_storage) round_to(params_of(*w.optimizers[o]), run.compute);
        if (outcome == kSkipped) clear_gradients(*w.optimizers[o]);
      }
    }
    std::vector<std::vector<at::Tensor>> params;
    for (const auto& o : w.optimizers) params.push_back(params_of(*o));
    trace.values.push_back(stepped_values(params));
  }
  return trace;
}

}  // namespace amp::scenarios
