// SPDX-License-Identifier: BSD-3-Clause
#include "optim/optimizer_kinds.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <string>

namespace amp::detail {

using namespace torch::optim;

optim::internal::Fused* fused_optimizer(Optimizer& optimizer) { return dynamic_cast<optim::internal::Fused*>(&optimizer); }

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

bool non_negative_state(const char* name) {
  const std::string n = name;
  return n == "exp_avg_sq" || n == "max_exp_avg_sq" || n == "sum" || n == "square_avg";
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

namespace {

at::Tensor value_named(const std::vector<StateTensor>& values, const char* name) {
  for (const StateTensor& v : values) {
    if (std::string(v.name) == name) return v.value;
  }
  return {};
}

template <class State>
std::unique_ptr<OptimizerParamState> adam_state(const std::vector<StateTensor>& values, int64_t step) {
  auto s = std::make_unique<State>();
  s->step(step);
  s->exp_avg(value_named(values, "exp_avg"));
  s->exp_avg_sq(value_named(values, "exp_avg_sq"));
  s->max_exp_avg_sq(value_named(values, "max_exp_avg_sq"));
  return s;
}

}  // namespace

std::unique_ptr<OptimizerParamState> make_state(const OptimizerOptions& options,
                                                const std::vector<StateTensor>& values, int64_t step) {
  if (dynamic_cast<const SGDOptions*>(&options)) {
    auto s = std::make_unique<SGDParamState>();
    s->momentum_buffer(value_named(values, "momentum_buffer"));
    return s;
  }
  if (dynamic_cast<const AdamOptions*>(&options)) return adam_state<AdamParamState>(values, step);
  if (dynamic_cast<const AdamWOptions*>(&options)) return adam_state<AdamWParamState>(values, step);
  if (dynamic_cast<const AdagradOptions*>(&options)) {
    auto s = std::make_unique<AdagradParamState>();
    s->step(step);
    s->sum(value_named(values, "sum"));
    return s;
  }
  if (dynamic_cast<const RMSpropOptions*>(&options)) {
    auto s = std::make_unique<RMSpropParamState>();
    s->step(step);
    s->square_avg(value_named(values, "square_avg"));
    s->momentum_buffer(value_named(values, "momentum_buffer"));
    s->grad_avg(value_named(values, "grad_avg"));
    return s;
  }
  return nullptr;
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
