#include "optimizer_state_load.h"

#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

namespace amp::detail {
namespace {

// State tensors of the optimizers LibTorch ships, with whether they must exist.
struct StateTensor {
  const char* name;
  at::Tensor value;
  bool required;
};

std::vector<StateTensor> state_tensors(const torch::optim::OptimizerParamState& state, int64_t& step) {
  using namespace torch::optim;
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
  return {};  // another optimizer: its own load is trusted
}

// The numeric options of LibTorch's optimizers: steps compute with them in
// the parameters' dtype, so each must be finite and fit float32.
std::vector<std::pair<const char*, double>> numeric_options(const torch::optim::OptimizerOptions& options) {
  using namespace torch::optim;
  if (auto* o = dynamic_cast<const SGDOptions*>(&options)) {
    return {{"lr", o->lr()}, {"momentum", o->momentum()}, {"dampening", o->dampening()}, {"weight_decay", o->weight_decay()}};
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
    return {{"lr", o->lr()}, {"alpha", o->alpha()}, {"eps", o->eps()}, {"weight_decay", o->weight_decay()},
            {"momentum", o->momentum()}};
  }
  return {};
}

void check_state_fits_params(const torch::optim::Optimizer& optimizer) {
  size_t index = 0, group_index = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& [name, value] : numeric_options(group.options())) {
      TORCH_CHECK(std::isfinite(value) && std::abs(value) <= std::numeric_limits<float>::max(), "parameter group ",
                  group_index, " has ", name, "=", value, ", which is not a finite float32 value");
    }
    ++group_index;
    for (const auto& p : group.params()) {
      const auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it != optimizer.state().end()) {
        int64_t step = 0;
        for (const StateTensor& t : state_tensors(*it->second, step)) {
          TORCH_CHECK(t.value.defined() || !t.required, "the state of parameter ", index, " has no '", t.name, "'");
          if (!t.value.defined()) continue;
          TORCH_CHECK(t.value.sizes() == p.sizes() && t.value.scalar_type() == p.scalar_type() &&
                          t.value.device() == p.device(),
                      "the state '", t.name, "' of parameter ", index, " is ", t.value.scalar_type(), t.value.sizes(),
                      " on ", t.value.device(), " but the parameter is ", p.scalar_type(), p.sizes(), " on ",
                      p.device());
        }
        TORCH_CHECK(step >= 0, "the state of parameter ", index, " has step count ", step);
      }
      ++index;
    }
  }
}

}  // namespace

std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
  std::stringstream before;
  {
    torch::serialize::OutputArchive saved;
    optimizer.save(saved);
    saved.save_to(before);
  }
  try {
    optimizer.load(archive);
    check_state_fits_params(optimizer);
  } catch (const std::exception& e) {
    torch::serialize::InputArchive saved;
    saved.load_from(before);
    optimizer.state().clear();
    optimizer.load(saved);
    TORCH_CHECK(false, "amp: cannot load the optimizer's state; nothing was changed. Was it saved from "
                "the same model and optimizer? Cause: ", message_of(e));
  }
}

}  // namespace amp::detail
