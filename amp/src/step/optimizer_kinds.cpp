#include "step/optimizer_kinds.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace amp::detail {

using namespace torch::optim;

optim::Fused* fused_optimizer(Optimizer& optimizer) { return dynamic_cast<optim::Fused*>(&optimizer); }

std::optional<double> optimizer_eps(const OptimizerOptions& options) {
  if (auto* o = dynamic_cast<const AdamOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const AdamWOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const RMSpropOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const AdagradOptions*>(&options)) return o->eps();
  return std::nullopt;
}

std::vector<StateTensor> state_tensors(const OptimizerParamState& state, int64_t& step) {
  if (auto* s = dynamic_cast<const SGDParamState*>(&state)) return {{"momentum_buffer", s->momentum_buffer(), false}};
  if (auto* s = dynamic_cast<const AdamParamState*>(&state)) {
    step = s->step();
    return {{"exp_avg", s->exp_avg(), true}, {"exp_avg_sq", s->exp_avg_sq(), true},
            {"max_exp_avg_sq", s->max_exp_avg_sq(), false}};
  }
  if (auto* s = dynamic_cast<const AdamWParamState*>(&state)) {
    step = s->step();
    return {{"exp_avg", s->exp_avg(), true}, {"exp_avg_sq", s->exp_avg_sq(), true},
            {"max_exp_avg_sq", s->max_exp_avg_sq(), false}};
  }
  if (auto* s = dynamic_cast<const AdagradParamState*>(&state)) {
    step = s->step();
    return {{"sum", s->sum(), true}};
  }
  if (auto* s = dynamic_cast<const RMSpropParamState*>(&state)) {
    step = s->step();
    return {{"square_avg", s->square_avg(), true}, {"momentum_buffer", s->momentum_buffer(), false},
            {"grad_avg", s->grad_avg(), false}};
  }
  return {};
}

void set_step_count(OptimizerParamState& state, int64_t steps) {
  if (auto* s = dynamic_cast<AdamParamState*>(&state)) s->step(steps);
  if (auto* s = dynamic_cast<AdamWParamState*>(&state)) s->step(steps);
  if (auto* s = dynamic_cast<AdagradParamState*>(&state)) s->step(steps);
  if (auto* s = dynamic_cast<RMSpropParamState*>(&state)) s->step(steps);
}

void count_step(OptimizerParamState& state) {
  int64_t steps = 0;
  (void)state_tensors(state, steps);
  set_step_count(state, steps + 1);
}

std::vector<std::pair<const char*, double>> numeric_options(const OptimizerOptions& options) {
  if (auto* o = dynamic_cast<const SGDOptions*>(&options)) {
    return {{"lr", o->lr()}, {"momentum", o->momentum()}, {"dampening", o->dampening()},
            {"weight_decay", o->weight_decay()}};
  }
  if (auto* o = dynamic_cast<const AdamOptions*>(&options)) {
    return {{"lr", o->lr()}, {"beta1", std::get<0>(o->betas())}, {"beta2", std::get<1>(o->betas())},
            {"eps", o->eps()}, {"weight_decay", o->weight_decay()}};
  }
  if (auto* o = dynamic_cast<const AdamWOptions*>(&options)) {
    return {{"lr", o->lr()}, {"beta1", std::get<0>(o->betas())}, {"beta2", std::get<1>(o->betas())},
            {"eps", o->eps()}, {"weight_decay", o->weight_decay()}};
  }
  if (auto* o = dynamic_cast<const AdagradOptions*>(&options)) {
    return {{"lr", o->lr()}, {"lr_decay", o->lr_decay()}, {"weight_decay", o->weight_decay()},
            {"initial_accumulator_value", o->initial_accumulator_value()}, {"eps", o->eps()}};
  }
  if (auto* o = dynamic_cast<const RMSpropOptions*>(&options)) {
    return {{"lr", o->lr()}, {"alpha", o->alpha()}, {"eps", o->eps()},
            {"weight_decay", o->weight_decay()}, {"momentum", o->momentum()}};
  }
  return {};
}

}  // namespace amp::detail
