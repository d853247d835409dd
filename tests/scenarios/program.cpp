// SPDX-License-Identifier: BSD-3-Clause
// Draws random training programs (program.h) from a seed.
#include "program.h"

#include <algorithm>
#include <random>
#include <set>
#include <sstream>

namespace amp::scenarios {
namespace {

class Draw {
 public:
  explicit Draw(uint64_t seed) : random_(seed) {}
  int between(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(random_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(random_); }
  template <class T>
  const T& pick(const std::vector<T>& v) { return v[between(0, static_cast<int>(v.size()) - 1)]; }
  template <class T>
  void shuffle(std::vector<T>& v) { std::shuffle(v.begin(), v.end(), random_); }

 private:
  std::mt19937_64 random_;
};

ModelSpec draw_model(Draw& draw) {
  ModelSpec m;
  m.token_input = draw.chance(0.25);
  // A norm never follows a norm (within a model or across a chain, so a
  // model never ends with one): a norm's output is invariant to the
  // affine parameters of a norm right before it, whose true gradients are
  // then zero and whose Adam updates would be pure rounding noise.
  const auto is_norm = [](Block b) { return b == Block::kBatchNorm || b == Block::kLayerNorm; };
  const int blocks = draw.between(1, 3);
  for (int i = 0; i < blocks; ++i) {
    const Block b = draw.pick(std::vector<Block>{Block::kLinear, Block::kLinear, Block::kConv1d, Block::kConv2d,
                                                 Block::kBatchNorm, Block::kLayerNorm});
    if (is_norm(b) && !m.blocks.empty() && is_norm(m.blocks.back())) continue;
    m.blocks.push_back(b);
  }
  if (is_norm(m.blocks.back())) m.blocks.push_back(Block::kLinear);
  m.affine_norms = draw.chance(0.7);
  return m;
}

OptimizerSpec draw_optimizer(Draw& draw) {
  OptimizerSpec o;
  o.kind = draw.pick(std::vector<OptimizerKind>{OptimizerKind::kSGD, OptimizerKind::kAdam, OptimizerKind::kAdamW});
  if (o.kind == OptimizerKind::kSGD) {
    o.lr = draw.pick(std::vector<double>{0.05, 0.1});
    o.momentum = draw.pick(std::vector<double>{0.0, 0.9});
    o.nesterov = o.momentum > 0 && draw.chance(0.3);
  } else {
    o.lr = draw.pick(std::vector<double>{0.01, 0.02});
    o.amsgrad = draw.chance(0.25);
  }
  o.weight_decay = draw.chance(0.3) ? 0.01 : 0.0;
  return o;
}

// A loss whose chain starts at `first`: token models read data only.
LossSpec draw_loss(Draw& draw, const Program& p, int first) {
  LossSpec loss;
  loss.chain = {first};
  std::vector<int> rest;
  for (int m = 0; m < static_cast<int>(p.models.size()); ++m) {
    if (m != first && !p.models[m].token_input) rest.push_back(m);
  }
  draw.shuffle(rest);
  const int extra = draw.between(0, static_cast<int>(rest.size()));
  loss.chain.insert(loss.chain.end(), rest.begin(), rest.begin() + extra);
  if (loss.chain.size() > 1 && draw.chance(0.35)) {
    loss.detach_after = draw.between(0, static_cast<int>(loss.chain.size()) - 2);
  }
  loss.kind = draw.pick(std::vector<LossKind>{LossKind::kMse, LossKind::kSoftplusMean, LossKind::kCrossEntropy});
  return loss;
}

// Fills in the guard: every optimizer stepped in the phase that owns a
// reached model. Returns false when the loss reaches none of them.
bool assign_guard(const Program& p, const Phase& phase, LossSpec& loss) {
  std::set<int> guard;
  for (int m : reached_models(loss)) {
    const int o = owner_of(p, m);
    if (std::find(phase.steps.begin(), phase.steps.end(), o) != phase.steps.end()) guard.insert(o);
  }
  loss.guard.assign(guard.begin(), guard.end());
  return !loss.guard.empty();
}

Phase draw_phase(Draw& draw, const Program& p, std::vector<int> steps) {
  Phase phase;
  phase.steps = std::move(steps);
  const int wanted = draw.between(1, 3);
  for (int attempt = 0; attempt < 20 && static_cast<int>(phase.losses.size()) < wanted; ++attempt) {
    LossSpec loss = draw_loss(draw, p, draw.between(0, static_cast<int>(p.models.size()) - 1));
    if (assign_guard(p, phase, loss)) phase.losses.push_back(loss);
  }
  // Every model the phase steps gets gradients from some loss.
  for (int o : phase.steps) {
    for (int m : p.optimizers[o].models) {
      bool reached = false;
      for (const auto& loss : phase.losses) {
        const auto r = reached_models(loss);
        reached = reached || std::find(r.begin(), r.end(), m) != r.end();
      }
      if (reached) continue;
      LossSpec loss;
      loss.chain = {m};
      loss.kind = draw.pick(std::vector<LossKind>{LossKind::kMse, LossKind::kSoftplusMean, LossKind::kCrossEntropy});
      assign_guard(p, phase, loss);
      phase.losses.push_back(loss);
    }
  }
  if (phase.losses.size() == 1 && draw.chance(0.3)) phase.micro_batches = draw.between(2, 3);
  if (draw.chance(0.3)) phase.losses.back().clip = draw.pick(std::vector<double>{0.05, 0.5});
  if (phase.micro_batches == 1 && draw.chance(0.2)) {
    LossSpec& loss = phase.losses[draw.between(0, static_cast<int>(phase.losses.size()) - 1)];
    loss.penalty = 0.1;
  }
  return phase;
}

bool leaks(const Program& p) {
  for (const Phase& phase : p.phases) {
    for (const LossSpec& loss : phase.losses) {
      for (int m : reached_models(loss)) {
        if (std::find(loss.guard.begin(), loss.guard.end(), owner_of(p, m)) == loss.guard.end()) return true;
      }
    }
  }
  return false;
}

const char* name(Block b) {
  switch (b) {
    case Block::kLinear: return "Linear";
    case Block::kConv1d: return "Conv1d";
    case Block::kConv2d: return "Conv2d";
    case Block::kBatchNorm: return "BatchNorm";
    case Block::kLayerNorm: return "LayerNorm";
    case Block::kTableView: return "TableView";
  }
  return "?";
}
const char* name(OptimizerKind k) {
  return k == OptimizerKind::kSGD ? "SGD" : k == OptimizerKind::kAdam ? "Adam" : "AdamW";
}
const char* name(LossKind k) {
  return k == LossKind::kMse ? "mse" : k == LossKind::kSoftplusMean ? "softplus_mean" : "cross_entropy";
}
const char* name(Zero z) {
  return z == Zero::kOptimizer ? "optimizer->zero_grad()" : z == Zero::kModel ? "model->zero_grad()" : "never";
}
const char* name(FaultKind k) {
  return k == FaultKind::kInfGradient ? "inf gradient" : k == FaultKind::kNaNGradient ? "NaN gradient" : "NaN loss";
}

template <class T>
std::string list(const std::vector<T>& v) {
  std::ostringstream out;
  for (size_t i = 0; i < v.size(); ++i) out << (i ? "," : "") << v[i];
  return out.str();
}

}  // namespace

std::vector<int> reached_models(const LossSpec& loss) {
  return {loss.chain.begin() + (loss.detach_after + 1), loss.chain.end()};
}

int owner_of(const Program& program, int model) {
  for (size_t o = 0; o < program.optimizers.size(); ++o) {
    const auto& owned = program.optimizers[o].models;
    if (std::find(owned.begin(), owned.end(), model) != owned.end()) return static_cast<int>(o);
  }
  return -1;
}

namespace {

// Makes `p` a program Properties::step_in_backward trains as the ordinary
// step does (program.h): amp's fused optimizers, a static scale without
// faults, no exception, clipping, penalty or accumulation, gradients
// zeroed, and in each phase a guard per optimizer at most (later losses
// that would guard one again are dropped).
void fit_step_in_backward(Program& p) {
  p.fused_step = true;
  p.dynamic_scaling = false;
  p.faults.clear();
  p.exception.reset();
  if (p.zero == Zero::kNever) p.zero = Zero::kOptimizer;
  for (Phase& phase : p.phases) {
    phase.micro_batches = 1;
    std::vector<bool> guarded(p.optimizers.size(), false);
    std::vector<LossSpec> kept;
    for (LossSpec& loss : phase.losses) {
      const bool again = std::any_of(loss.guard.begin(), loss.guard.end(), [&](int o) { return guarded[o]; });
      if (again) continue;
      for (int o : loss.guard) guarded[o] = true;
      loss.clip.reset();
      loss.penalty = 0;
      kept.push_back(loss);
    }
    phase.losses = std::move(kept);
  }
  p.step_in_backward = true;
}

// Whether blocks `r` of `m` compute each output row from its input row
// alone, so they can run in slices of the batch: not BatchNorm (batch
// statistics), not a position table sliced to the batch's size, not nested.
bool maps_rows_to_rows(const ModelSpec& m, const RecomputedBlocks& r) {
  if (r.nested) return false;
  for (size_t i = r.first; i < r.last; ++i) {
    if (m.blocks[i] == Block::kBatchNorm) return false;
    if (m.blocks[i] == Block::kTableView && m.table_view == TableView::kPositionSlice) return false;
  }
  return true;
}

// Makes `p` a program sharded data parallel trains (program.h).
void fit_sharding(Program& p, Program::Sharding sharding) {
  std::vector<Fault> kept;
  for (const Fault& f : p.faults) {
    if (f.kind == FaultKind::kNaNLoss) kept.push_back(f);
  }
  p.faults = std::move(kept);
  for (Phase& phase : p.phases) {
    for (LossSpec& loss : phase.losses) loss.penalty = 0;
  }
  p.sharding = sharding;
}

}  // namespace

Program generate_program(uint64_t seed) {
  Draw draw(seed);
  Program p;
  p.seed = seed;
  const int models = draw.between(1, 3);
  for (int i = 0; i < models; ++i) p.models.push_back(draw_model(draw));
  const int optimizers = draw.between(1, std::min(2, models));
  std::vector<int> order(models);
  for (int i = 0; i < models; ++i) order[i] = i;
  draw.shuffle(order);
  for (int o = 0; o < optimizers; ++o) p.optimizers.push_back(draw_optimizer(draw));
  for (int i = 0; i < models; ++i) {
    const int o = i < optimizers ? i : draw.between(0, optimizers - 1);
    p.optimizers[o].models.push_back(order[i]);
  }
  for (auto& o : p.optimizers) std::sort(o.models.begin(), o.models.end());

  if (optimizers == 2 && draw.chance(0.6)) {  // GAN-style: each optimizer has its phase
    const int first = draw.between(0, 1);
    p.phases.push_back(draw_phase(draw, p, {first}));
    p.phases.push_back(draw_phase(draw, p, {1 - first}));
  } else {
    std::vector<int> all(optimizers);
    for (int o = 0; o < optimizers; ++o) all[o] = o;
    p.phases.push_back(draw_phase(draw, p, all));
  }

  int total_losses = 0;
  for (const auto& phase : p.phases) total_losses += static_cast<int>(phase.losses.size());
  p.num_losses = draw.chance(0.5) ? total_losses : 1;
  int index = 0;
  for (auto& phase : p.phases) {
    for (auto& loss : phase.losses) loss.loss_id = index++ % p.num_losses;
  }

  p.iterations = draw.between(3, 5);
  // Leaked gradients must be zeroed before the model they reach is stepped,
  // and an accumulation starts from zeroed gradients (amp refuses otherwise).
  const bool accumulates = std::any_of(p.phases.begin(), p.phases.end(), [](const Phase& ph) { return ph.micro_batches > 1; });
  p.zero = leaks(p) || accumulates ? draw.pick(std::vector<Zero>{Zero::kOptimizer, Zero::kModel})
                    : draw.pick(std::vector<Zero>{Zero::kOptimizer, Zero::kModel, Zero::kNever});
  // float16 only without gradient penalties: their double backward through
  // norms overflows float16 at any useful scale, and every step would skip.
  const bool penalty = std::any_of(p.phases.begin(), p.phases.end(), [](const Phase& ph) {
    return std::any_of(ph.losses.begin(), ph.losses.end(), [](const LossSpec& l) { return l.penalty > 0; });
  });
  p.float16 = !penalty && draw.chance(0.3);
  p.init_scale = draw.pick(std::vector<double>{64, 256, 1024});
  p.growth_interval = draw.between(1, 3);

  const auto random_place = [&](int& iteration, int& phase) {
    iteration = draw.between(0, p.iterations - 1);
    phase = draw.between(0, static_cast<int>(p.phases.size()) - 1);
  };
  if (draw.chance(0.5)) {
    const int faults = draw.between(1, 2);
    for (int i = 0; i < faults; ++i) {
      Fault f{};
      random_place(f.iteration, f.phase);
      const Phase& phase = p.phases[f.phase];
      f.loss = draw.between(0, static_cast<int>(phase.losses.size()) - 1);
      f.micro_batch = draw.between(0, phase.micro_batches - 1);
      f.kind = draw.pick(std::vector<FaultKind>{FaultKind::kInfGradient, FaultKind::kNaNGradient, FaultKind::kNaNLoss});
      p.faults.push_back(f);
    }
  }
  p.dynamic_scaling = !p.faults.empty() || draw.chance(0.5);
  if (draw.chance(0.2)) {
    GuardException e{};
    random_place(e.iteration, e.phase);
    e.after_unscale = draw.chance(0.5);
    // Kept apart from faults (a verdict left queued by an abandoned phase is
    // another scenario).
    const Phase& phase = p.phases[e.phase];
    const bool clashes = std::any_of(p.faults.begin(), p.faults.end(), [&](const Fault& f) {
      return f.iteration == e.iteration && f.phase == e.phase;
    });
    if (!clashes && phase.micro_batches == 1) p.exception = e;
  }
  if (draw.chance(0.25)) {
    p.restart_before = draw.between(1, p.iterations - 1);
    if (draw.chance(0.5)) p.fresh_process_level = draw.pick(std::vector<OptLevel>{O0, O1, O2, O3, O4, O5});
  }
  p.fused_step = draw.chance(0.7);  // drawn late: earlier seeds keep their programs
  for (ModelSpec& m : p.models) {
    if (!draw.chance(0.3)) continue;
    const int n = static_cast<int>(m.blocks.size());
    RecomputedBlocks r;
    r.first = static_cast<size_t>(draw.between(0, n - 1));
    r.last = static_cast<size_t>(draw.between(static_cast<int>(r.first) + 1, n));
    r.nested = r.last - r.first >= 2 && draw.chance(0.5);
    m.recomputed = r;
  }
  p.fp8 = !penalty && draw.chance(0.4);
  for (ModelSpec& m : p.models) {  // drawn last: earlier seeds keep the rest of their programs
    if (!draw.chance(0.4)) continue;
    const int at = draw.between(0, static_cast<int>(m.blocks.size()));  // 0: before any other op
    m.blocks.insert(m.blocks.begin() + at, Block::kTableView);
    m.table_view = draw.pick(std::vector<TableView>{TableView::kPositionSlice, TableView::kTransposed, TableView::kHeads});
    if (m.recomputed && static_cast<size_t>(at) < m.recomputed->first) ++m.recomputed->first;
    if (m.recomputed && static_cast<size_t>(at) < m.recomputed->last) ++m.recomputed->last;
  }
  if (draw.chance(0.25)) fit_step_in_backward(p);  // drawn last, as above
  if (!p.step_in_backward && draw.chance(0.35)) {  // drawn last, as above
    fit_sharding(p, draw.chance(0.6) ? Program::Sharding::kZero3 : Program::Sharding::kZero2);
  }
  for (ModelSpec& m : p.models) {  // drawn last, as above
    if (m.recomputed && maps_rows_to_rows(m, *m.recomputed) && draw.chance(0.5)) m.recomputed->slices = draw.between(2, 3);
  }
  for (ModelSpec& m : p.models) {  // drawn last, as above
    if (m.recomputed && draw.chance(0.5)) m.recomputed->keep = draw.chance(0.5) ? Kept::kGemmOutputs : Kept::kSeveralOps;
  }
  return p;
}

std::string describe(const Program& p) {
  std::ostringstream out;
  for (size_t m = 0; m < p.models.size(); ++m) {
    out << "  model " << m << ": " << (p.models[m].token_input ? "Embedding " : "");
    for (Block b : p.models[m].blocks) out << name(b) << " ";
    const TableView v = p.models[m].table_view;
    if (std::count(p.models[m].blocks.begin(), p.models[m].blocks.end(), Block::kTableView) > 0) {
      out << (v == TableView::kPositionSlice ? "(table sliced) " : v == TableView::kTransposed ? "(table transposed) "
                                                                                               : "(table in heads) ");
    }
    out << (p.models[m].affine_norms ? "" : "(norms not affine)");
    if (const auto& r = p.models[m].recomputed) {
      out << " blocks " << r->first << ".." << r->last - 1 << " recomputed" << (r->nested ? " (nested)" : "")
          << (r->slices > 1 ? " in " + std::to_string(r->slices) + " slices" : "")
          << (r->keep == Kept::kGemmOutputs  ? " keeping GEMM outputs"
              : r->keep == Kept::kSeveralOps ? " keeping GEMM, tanh and layer norm outputs"
                                             : "");
    }
    out << "\n";
  }
  for (size_t o = 0; o < p.optimizers.size(); ++o) {
    const auto& s = p.optimizers[o];
    out << "  optimizer " << o << ": " << name(s.kind) << " lr " << s.lr << " momentum " << s.momentum
        << (s.nesterov ? " nesterov" : "") << " weight_decay " << s.weight_decay << (s.amsgrad ? " amsgrad" : "")
        << " over models " << list(s.models) << "\n";
  }
  for (size_t ph = 0; ph < p.phases.size(); ++ph) {
    const auto& phase = p.phases[ph];
    out << "  phase " << ph << ": steps optimizer(s) " << list(phase.steps) << "; micro-batches: " << phase.micro_batches
        << "\n";
    for (size_t l = 0; l < phase.losses.size(); ++l) {
      const auto& loss = phase.losses[l];
      out << "    loss " << l << ": " << name(loss.kind) << " of chain " << list(loss.chain);
      if (loss.detach_after >= 0) out << " detached after position " << loss.detach_after;
      out << ", guard over optimizers " << list(loss.guard) << ", loss_id " << loss.loss_id;
      if (loss.clip) out << ", unscale + clip to " << *loss.clip;
      if (loss.penalty > 0) out << ", gradient penalty " << loss.penalty;
      out << "\n";
    }
  }
  out << "  " << p.iterations << " iterations, zeroing " << name(p.zero) << ", num_losses " << p.num_losses
      << ", O1-O3 dtype " << (p.float16 ? "float16" : "bfloat16") << ", scaling "
      << (p.dynamic_scaling ? "dynamic from " + std::to_string(p.init_scale) : std::string("level default"))
      << ", growth_interval " << p.growth_interval << ", " << (p.fused_step ? "fused" : "LibTorch's own")
      << " optimizer step" << (p.fp8 ? ", O5 with fp8" : "")
      << (p.step_in_backward ? ", step in backward (O0, O3, O4, O6)" : "")
      << (p.sharding == Program::Sharding::kZero2   ? ", sharded over one rank (ZeRO-2; O2, O5, O6)"
          : p.sharding == Program::Sharding::kZero3 ? ", sharded over one rank with the weights (ZeRO-3; O2, O5, O6)"
                                                    : "")
      << "\n";
  for (const Fault& f : p.faults) {
    out << "  fault: " << name(f.kind) << " at iteration " << f.iteration << " phase " << f.phase << " loss "
        << f.loss << " micro-batch " << f.micro_batch << "\n";
  }
  if (p.exception) {
    out << "  exception inside the last guard of iteration " << p.exception->iteration << " phase "
        << p.exception->phase << (p.exception->after_unscale ? " after unscale()" : " after backward") << "\n";
  }
  if (p.restart_before) {
    out << "  save, rebuild and load before iteration " << *p.restart_before;
    if (p.fresh_process_level) out << " (in a fresh process at " << to_string(*p.fresh_process_level) << ")";
    out << "\n";
  }
  return out.str();
}

}  // namespace amp::scenarios
