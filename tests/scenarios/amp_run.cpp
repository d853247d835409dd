// SPDX-License-Identifier: BSD-3-Clause
// A program under amp, written as a user writes the loop: zero_grad, forward,
// scale_loss around backward, unscale() before clipping, step().
#include "runs.h"
#include "workload.h"

#include <amp/internal/loss_scaling.h>

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>

namespace amp::scenarios {
namespace {

// What the user's code throws inside a guard.
struct UserError : std::runtime_error {
  UserError() : std::runtime_error("user code failed inside the guard") {}
};

std::vector<OptimizerPtr> initialize_workload(Handle& handle, const Workload& w, const LevelRun& run) {
  std::vector<OptimizerPtr> optimizers(w.optimizers.begin(), w.optimizers.end());
  return handle.initialize(w.modules(), std::move(optimizers), run.options).second;
}

// Puts inf or NaN into one gradient of a model the guard's optimizers step.
void inject(const Program& p, const LossSpec& loss, const Workload& w, FaultKind kind) {
  for (int m : reached_models(loss)) {
    if (std::find(loss.guard.begin(), loss.guard.end(), owner_of(p, m)) == loss.guard.end()) continue;
    at::Tensor grad = w.models[m]->parameters().front().grad();
    TORCH_CHECK(grad.defined() && grad.is_contiguous(), "scenario: no gradient to inject into");
    grad.view(-1)[0].fill_(kind == FaultKind::kInfGradient ? std::numeric_limits<double>::infinity()
                                                           : std::numeric_limits<double>::quiet_NaN());
    return;
  }
}

std::vector<at::Tensor> stepped_tensors(const std::vector<OptimizerPtr>& optimizers, const std::vector<int>& which) {
  std::vector<at::Tensor> out;
  for (int o : which) {
    for (const auto& t : master_params(*optimizers[o])) out.push_back(t);
  }
  return out;
}

// Runs one phase's losses; false when the user's code threw inside a guard.
bool run_losses(const Program& p, int it, int ph, const Workload& w, const std::vector<OptimizerPtr>& optimizers,
                Trace& trace) {
  const Phase& phase = p.phases[ph];
  const bool throws = p.exception && p.exception->iteration == it && p.exception->phase == ph;
  for (int l = 0; l < static_cast<int>(phase.losses.size()); ++l) {
    const LossSpec& loss = phase.losses[l];
    std::vector<OptimizerPtr> covered;
    for (int o : loss.guard) covered.push_back(optimizers[o]);
    for (int mb = 0; mb < phase.micro_batches; ++mb) {
      const Fault* fault = nullptr;
      for (const Fault& f : p.faults) {
        if (f.iteration == it && f.phase == ph && f.loss == l && f.micro_batch == mb) fault = &f;
      }
      at::Tensor value = loss_forward(w, loss, batch_for(p, it, ph, l, mb), torch::kFloat);
      if (fault && fault->kind == FaultKind::kNaNLoss) value = value * std::numeric_limits<float>::quiet_NaN();
      if (loss.penalty > 0) {  // GradScaler's recipe: gradients of the scaled loss, unscaled by hand
        const at::Tensor scale = internal::live_scaling(loss.loss_id).scale_tensor(value.device());
        const auto params = w.models[penalty_model(loss)]->parameters();
        const auto grads = torch::autograd::grad({value.to(at::kFloat) * scale}, params, {}, true, true, true);
        for (const auto& g : grads) {
          if (g.defined()) value = value + loss.penalty * (g.to(at::kFloat) / scale).pow(2).sum();
        }
      }
      const bool delay = mb + 1 < phase.micro_batches;
      const bool last = l + 1 == static_cast<int>(phase.losses.size()) && !delay;
      try {
        scale_loss guard(value, covered, {loss.loss_id, delay});
        guard.backward();
        if (fault && fault->kind != FaultKind::kNaNLoss) inject(p, loss, w, fault->kind);
        if (throws && last) {
          if (p.exception->after_unscale) guard.unscale();
          throw UserError();
        }
        if (loss.clip && !delay) {
          guard.unscale();
          torch::nn::utils::clip_grad_norm_(stepped_tensors(optimizers, loss.guard), *loss.clip);
        }
        guard.finish();
      } catch (const UserError&) {
        return false;
      }
      if (!delay) trace.scales.push_back(loss_scale(loss.loss_id));
    }
  }
  return true;
}

void append(Trace& trace, Trace&& rest) {
  for (auto& row : rest.outcomes) trace.outcomes.push_back(std::move(row));
  for (double s : rest.scales) trace.scales.push_back(s);
  for (auto& v : rest.values) trace.values.push_back(std::move(v));
}

}  // namespace

Trace run_amp(const Program& p, const LevelRun& run, const AmpRunOptions& options) {
  const bool resumed = !options.resume_from.empty();
  Handle handle;
  // A resumed run starts from other weights: only the checkpoint decides.
  Workload w = build_workload(p, torch::kFloat, resumed ? p.seed + 1 : p.seed, p.fused_step);
  std::vector<OptimizerPtr> optimizers = initialize_workload(handle, w, run);
  if (resumed) load_checkpoint(options.resume_from, w.modules(), optimizers);
  Trace trace;
  for (int it = resumed ? *p.restart_before : 0; it < p.iterations; ++it) {
    if (!resumed && p.restart_before == it) {
      const std::string path = options.scratch_dir + "/seed" + std::to_string(p.seed) + "_" + to_string(run.level) + ".pt";
      save_checkpoint(path, w.modules(), optimizers);
      if (p.fresh_process_level == run.level) {
        const std::string trace_path = path + ".trace";
        const std::string command = options.self + " --seed=" + std::to_string(p.seed) + " --opt_level=" +
                                    to_string(run.level) + " --resume_from=" + path + " --trace_out=" + trace_path;
        const int status = std::system(command.c_str());
        TORCH_CHECK(status == 0, "scenario: the fresh process failed (status ", status, "): ", command);
        append(trace, load_trace(trace_path));
        std::remove(path.c_str());
        std::remove(trace_path.c_str());
        return trace;
      }
      handle.deinitialize();
      w = build_workload(p, torch::kFloat, p.seed + 1, p.fused_step);
      optimizers = initialize_workload(handle, w, run);
      load_checkpoint(path, w.modules(), optimizers);
      std::remove(path.c_str());
    }
    trace.outcomes.emplace_back(p.optimizers.size(), kNotStepped);
    for (int ph = 0; ph < static_cast<int>(p.phases.size()); ++ph) {
      const Phase& phase = p.phases[ph];
      zero_gradients(p, phase, w.models, optimizers);
      if (!run_losses(p, it, ph, w, optimizers, trace)) continue;  // the loop skips the phase's steps
      for (int o : phase.steps) {
        optimizers[o]->step();
        trace.outcomes.back()[o] = last_step_skipped(*optimizers[o]) ? kSkipped : kStepped;
      }
    }
    std::vector<std::vector<at::Tensor>> params;
    for (const auto& o : optimizers) params.push_back(master_params(*o));
    trace.values.push_back(stepped_values(params));
  }
  return trace;
}

}  // namespace amp::scenarios
