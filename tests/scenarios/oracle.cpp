// SPDX-License-Identifier: BSD-3-Clause
// What amp's run of a program must match: the expected outcomes and scales,
// and the float64 values within a tolerance derived from the low dtype.
//
// Tolerance, per stepped tensor after every iteration, in 2-norms:
//   |amp - reference| <= rtol * (|reference - initial| + share)
//                        + 4 (u / u32) |float32 - float64| + atol
// rtol bounds the relative error of the update, which low-precision forward
// and backward passes cause: 256 u for the unit roundoff u of the dtype amp
// computes in (u = 2^-8 bfloat16, 2^-11 float16, u32 = 2^-24 float32 at
// O0; with fp8, e5m2's 2^-3), at most 0.35, and 0.35 at O3, which also
// keeps optimizer state in the low dtype. Rounding errors scale with the whole computation, not with
// one tensor's update, so `share` adds the tensor's share of the update of
// all stepped tensors: |all updates| * sqrt(numel / total numel). Some
// values are ill-conditioned (a bias whose effect a later norm nearly
// cancels); the same program in plain float32 measures that against float64
// (both with unrounded storage, which at O3 would round the float32 error
// away), and its error scaled to the low dtype's roundoff is allowed on top.
// atol covers the rounding of stored values: each step may round an element
// differently, 4 u' |reference| per iteration, with u' the
// unit roundoff of the stored dtype (the low dtype at O3, else float32).
// Bugs of the kind this catches - a gradient used twice, lost, left scaled,
// or a step taken that should be skipped - move a tensor by a multiple of
// its own update.
#include "runs.h"
#include "../world_of_one.h"
#include <amp/internal/level_rules.h>

#include <algorithm>

#include <torch/torch.h>

#include <cmath>
#include <sstream>

namespace amp::scenarios {
namespace {

double unit_roundoff(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kBFloat16: return std::ldexp(1.0, -8);
    case c10::kHalf: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -24);
  }
}

}  // namespace

LevelRun level_run(const Program& p, OptLevel level) {
  LevelRun run{};
  run.level = level;
  Options o = level;
  o.verbosity = 0;
  o.num_losses = p.num_losses;
  if (p.float16) {
    PropertyOverrides half;
    half.cpu_dtype = c10::kHalf;
    try {
      internal::resolve_properties(level, half, c10::DeviceType::CPU);
      o.cpu_dtype = c10::kHalf;
    } catch (const c10::Error&) {  // a bfloat16-only level (O4/O5)
    }
  }
  // O6 rounds stochastically in amp's fused optimizers only; with
  // LibTorch's own it runs rounding to nearest (initialize refuses them otherwise).
  if (level == O6 && !p.fused_step) o.stochastic_rounding = false;
  if (level == O5 && p.fp8) o.fp8 = true;
  const bool shards = level == O2 || level == O5 || (level == O6 && p.fused_step);
  if (p.sharding != Program::Sharding::kNone && shards) {
    o.data_parallel.group = c10::make_intrusive<testing::WorldOfOne>();
    o.data_parallel.bucket_bytes = 64;  // several buckets, and gathers, per model
    o.data_parallel.shard = true;
    o.data_parallel.shard_weights = p.sharding == Program::Sharding::kZero3;
  }
  const Properties defaults = internal::resolve_properties(level, o, c10::DeviceType::CPU);
  if (p.dynamic_scaling || defaults.loss_scale.dynamic) o.loss_scale = LossScale::Dynamic(p.init_scale);
  o.dynamic_scaling.growth_interval = p.growth_interval;
  o.dynamic_scaling.max_loss_scale = p.max_scale;
  // A static scale without masters; not O3 with SGD, whose CPU kernel leaves
  // bfloat16 parameters to LibTorch's step (refused in backward).
  const bool sgd = std::any_of(p.optimizers.begin(), p.optimizers.end(),
                               [](const OptimizerSpec& s) { return s.kind == OptimizerKind::kSGD; });
  if (p.step_in_backward && !defaults.master_weights && !o.loss_scale && !(level == O3 && sgd)) o.step_in_backward = true;
  const Properties resolved = internal::resolve_properties(level, o, c10::DeviceType::CPU);
  run.options = o;
  const bool casts_model = resolved.cast_model_type && internal::is_low_precision(*resolved.cast_model_type);
  run.low_storage = casts_model && !resolved.master_weights;
  run.compute = casts_model || resolved.patch_torch_functions ? resolved.cpu_dtype : c10::kFloat;
  run.fp8 = resolved.fp8;
  return run;
}

Trace expected_trace(const Program& p, const LevelRun& run) {
  const Properties props = internal::resolve_properties(run.level, run.options, c10::DeviceType::CPU);
  struct Scaler {
    double scale;
    int64_t tracker = 0;
  };
  std::vector<Scaler> scalers(p.num_losses, Scaler{props.loss_scale.value});
  const DynamicScaling& d = props.dynamic_scaling;
  Trace trace;
  // Optimizers whose gradients hold an injected inf/NaN not yet cleared: a
  // clip inside a guard over several optimizers sees them (scale_loss.h).
  std::vector<bool> poisoned(p.optimizers.size(), false);
  for (int it = 0; it < p.iterations; ++it) {
    trace.outcomes.emplace_back(p.optimizers.size(), kNotStepped);
    if (p.restart_before == it) poisoned.assign(poisoned.size(), false);  // gradients are not saved
    for (int ph = 0; ph < static_cast<int>(p.phases.size()); ++ph) {
      const Phase& phase = p.phases[ph];
      for (int o : phase.steps) {  // zero_gradients(); model->zero_grad() cannot reach masters
        if (p.zero != Zero::kNever) poisoned[o] = false;
      }
      const bool throws = p.exception && p.exception->iteration == it && p.exception->phase == ph;
      std::vector<bool> skip(p.optimizers.size(), false);
      for (int l = 0; l < static_cast<int>(phase.losses.size()); ++l) {
        if (throws && l + 1 == static_cast<int>(phase.losses.size())) break;  // unwound: no update
        const LossSpec& loss = phase.losses[l];
        bool overflow = false;
        const Fault* fault = nullptr;
        for (const Fault& f : p.faults) {
          if (f.iteration == it && f.phase == ph && f.loss == l) fault = &f;
        }
        overflow = fault != nullptr;
        bool clip_sees_poison = false;
        if (loss.clip && loss.guard.size() > 1) {
          for (int o : loss.guard) clip_sees_poison = clip_sees_poison || poisoned[o];
        }
        Scaler& s = scalers[loss.loss_id];
        if (props.loss_scale.dynamic) {
          if (overflow) {
            s.scale = std::max(s.scale * d.backoff_factor, d.min_loss_scale.value_or(std::ldexp(1.0, -126)));
            s.tracker = 0;
          } else if (++s.tracker == d.growth_interval) {
            s.scale = std::min(s.scale * d.growth_factor, d.max_loss_scale);
            s.tracker = 0;
          }
        }
        trace.scales.push_back(s.scale);
        trace.discarded.emplace_back();
        if (p.fused_step) {
          for (int o : loss.guard) skip[o] = skip[o] || overflow || clip_sees_poison;
        } else if (props.loss_scale.dynamic) {  // the guard reads its verdict: drops, or steps what follows
          for (int o : loss.guard) {
            skip[o] = overflow;
            if (overflow) trace.discarded.back().push_back(o);
          }
        }
        if (fault && p.fused_step) {  // where amp_run's inject() or the NaN loss put non-finite gradients
          for (int m : reached_models(loss)) {
            const int owner = owner_of(p, m);
            if (std::find(loss.guard.begin(), loss.guard.end(), owner) == loss.guard.end()) continue;
            poisoned[owner] = true;
            if (fault->kind != FaultKind::kNaNLoss) break;  // one gradient of the first such model
          }
        }
      }
      if (throws) continue;
      for (int o : phase.steps) {
        trace.outcomes[it][o] = skip[o] ? kSkipped : kStepped;
        poisoned[o] = poisoned[o] && !skip[o];  // a skip discards
      }
    }
  }
  return trace;
}

Conditioning measure_conditioning(const Program& program, const LevelRun& run, const Trace& expected,
                                  const Trace& reference) {
  LevelRun unrounded = run;
  unrounded.low_storage = false;
  return {run.low_storage ? run_reference(program, unrounded, expected, torch::kDouble) : reference,
          run_reference(program, unrounded, expected, torch::kFloat)};
}

std::string compare(const LevelRun& run, const Trace& expected, const Trace& reference, const Conditioning& conditioning,
                    const Trace& actual, double& worst) {
  std::ostringstream why;
  if (actual.outcomes != expected.outcomes) {
    why << "step outcomes differ (0 stepped, 1 skipped, 2 not stepped); expected:";
    for (const auto& row : expected.outcomes) why << " " << c10::Join(",", row);
    why << "; got:";
    for (const auto& row : actual.outcomes) why << " " << c10::Join(",", row);
    return why.str();
  }
  if (actual.scales != expected.scales) {
    why << "loss scales after each guard differ; expected " << c10::Join(",", expected.scales) << "; got "
        << c10::Join(",", actual.scales);
    return why.str();
  }
  if (actual.values.size() != reference.values.size()) {
    why << "ran " << actual.values.size() << " iterations, expected " << reference.values.size();
    return why.str();
  }
  // float8: the gradients' e5m2 rounds at 2^-3.
  const double u = run.fp8 ? std::ldexp(1.0, -3) : unit_roundoff(run.compute);
  const double rtol = run.low_storage ? 0.35 : std::min(0.35, 256 * u);
  const double u32 = unit_roundoff(c10::kFloat);
  const double storage_u = run.low_storage ? u : unit_roundoff(c10::kFloat);
  for (size_t it = 0; it < actual.values.size(); ++it) {
    const auto& got = actual.values[it];  // sharded: flat pieces, one per parameter (one rank)
    const auto& want = reference.values[it];
    if (got.size() != want.size()) {
      why << "iteration " << it << ": " << got.size() << " stepped tensors, expected " << want.size();
      return why.str();
    }
    double moved_total = 0;
    int64_t numel_total = 0;
    for (size_t t = 0; t < want.size(); ++t) {
      moved_total += (want[t] - reference.initial[t]).pow(2).sum().item<double>();
      numel_total += want[t].numel();
    }
    moved_total = std::sqrt(moved_total);
    for (size_t t = 0; t < got.size(); ++t) {
      const double err = (got[t].reshape(-1) - want[t].reshape(-1)).norm().item<double>();
      const double moved = (want[t] - reference.initial[t]).norm().item<double>();
      const double share = moved_total * std::sqrt(static_cast<double>(want[t].numel()) / numel_total);
      const double sensitivity =
          (conditioning.float32.values[it][t] - conditioning.float64.values[it][t]).norm().item<double>() * (u / u32);
      const double bound = rtol * (moved + share) + 4 * sensitivity +
                           4 * storage_u * want[t].norm().item<double>() * (it + 1) + 1e-12;
      worst = std::max(worst, err / bound);
      if (!(err <= bound)) {  // also catches NaN
        why << "iteration " << it << ", stepped tensor " << t << " (shape " << want[t].sizes()
            << "): |amp - float64| = " << err << " exceeds " << bound << " (moved " << moved << " from its initial value)";
        return why.str();
      }
    }
  }
  return "";
}

void save_trace(const Trace& trace, const std::string& path) {
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> flat;
  for (const auto& row : trace.outcomes) flat.insert(flat.end(), row.begin(), row.end());
  const int64_t rows = static_cast<int64_t>(trace.outcomes.size());
  tensors.push_back(torch::tensor(flat, torch::kLong).reshape({rows, rows ? -1 : 0}));
  tensors.push_back(torch::tensor(trace.scales, torch::kDouble));
  for (const auto& values : trace.values) {
    for (const auto& v : values) tensors.push_back(v);
  }
  torch::save(tensors, path);
}

Trace load_trace(const std::string& path) {
  std::vector<at::Tensor> tensors;
  torch::load(tensors, path);
  Trace trace;
  const at::Tensor outcomes = tensors.at(0);
  for (int64_t r = 0; r < outcomes.size(0); ++r) {
    const at::Tensor row = outcomes[r].contiguous();
    trace.outcomes.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
  }
  const at::Tensor scales = tensors.at(1).contiguous();
  trace.scales.assign(scales.data_ptr<double>(), scales.data_ptr<double>() + scales.numel());
  const size_t rows = trace.outcomes.size();
  const size_t per_row = rows ? (tensors.size() - 2) / rows : 0;
  for (size_t r = 0; r < rows; ++r) {
    trace.values.emplace_back(tensors.begin() + 2 + r * per_row, tensors.begin() + 2 + (r + 1) * per_row);
  }
  return trace;
}

}  // namespace amp::scenarios
