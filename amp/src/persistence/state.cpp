// SPDX-License-Identifier: BSD-3-Clause
#include <amp/state.h>

#include "persistence/state_format.h"
#include "session/context.h"

#include <amp/opt_levels.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

namespace amp {
namespace {

int64_t read_int(torch::serialize::InputArchive& archive, const char* key) {
  at::Tensor value;
  TORCH_CHECK(archive.try_read(key, value), "amp: the archive has no '", key,
              "' entry; was it written by amp::save_state?");
  TORCH_CHECK(value.numel() == 1 && !value.is_floating_point(), "amp: entry '", key,
              "' should hold one integer, got ", value.scalar_type(), " with ", value.numel(),
              " values");
  return value.item<int64_t>();
}

// The level a checkpoint was saved at. amp saves its name; checkpoints
// written before that hold the enum's number, read through this frozen map.
OptLevel saved_opt_level(torch::serialize::InputArchive& archive) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read("opt_level", value), "amp: the archive has no 'opt_level' entry; "
              "was it written by amp::save_state?");
  if (value.isString()) return parse_opt_level(value.toStringRef());
  constexpr OptLevel kNumbered[] = {O0, O1, O2, O3, O4, O5};  // frozen: levels saved as numbers
  TORCH_CHECK(value.isTensor() && value.toTensor().numel() == 1 && !value.toTensor().is_floating_point(),
              "amp: entry 'opt_level' should hold a level name such as \"O2\", got ", value.tagKind());
  const int64_t number = value.toTensor().item<int64_t>();
  TORCH_CHECK(number >= 0 && number < static_cast<int64_t>(std::size(kNumbered)), "amp: entry "
              "'opt_level' holds ", number, ", which names no opt level.");
  return kNumbered[number];
}

}  // namespace

void save_state(torch::serialize::OutputArchive& archive) {
  auto context = detail::require_live_context("amp::save_state");
  detail::write_state_format(archive);
  archive.write("opt_level", c10::IValue(std::string(to_string(context->properties().opt_level))));
  archive.write("num_losses", at::scalar_tensor(static_cast<int64_t>(context->num_losses()),
                                                at::kLong));
  for (int i = 0; i < context->num_losses(); ++i) {
    torch::serialize::OutputArchive scaler(archive.compilation_unit());
    context->scaler(i).save(scaler);
    archive.write("loss_scaler" + std::to_string(i), scaler);
  }
  if (detail::StochasticRounding* rounding = context->rounding()) rounding->save(archive);
  if (detail::Fp8Gemms* fp8 = context->fp8()) fp8->save(archive, *context->parameter_names());
}

void load_state(torch::serialize::InputArchive& archive) {
  auto context = detail::require_live_context("amp::load_state");
  detail::read_state_format(archive, "state");  // every older format reads as format 1 did
  const OptLevel level = saved_opt_level(archive);
  const int64_t num_losses = read_int(archive, "num_losses");
  TORCH_CHECK(level == context->properties().opt_level, "amp: the state was saved at opt_level ",
              to_string(level), " but amp runs at ", to_string(context->properties().opt_level),
              "; initialize with the checkpoint's opt_level.");
  TORCH_CHECK(num_losses == context->num_losses(), "amp: the state holds ", num_losses,
              " loss scaler(s) but amp was initialized with num_losses=", context->num_losses(),
              "; initialize with num_losses=", num_losses, ".");
  for (const std::string& key : archive.keys()) {
    TORCH_CHECK(!detail::StochasticRounding::is_weights_entry(key) || context->rounding() != nullptr, "amp: the "
                "state holds the stochastic rounding streams of a run with stochastic_rounding (O6), but "
                "amp runs without it; initialize with the checkpoint's opt_level and overrides.");
    TORCH_CHECK(!detail::Fp8Gemms::is_entry(key) || context->fp8() != nullptr, "amp: the state holds the fp8 "
                "scales of a run with the fp8 property, but amp runs without it; initialize with fp8 = true.");
    const bool known = key == detail::kStateFormatEntry || key == "opt_level" || key == "num_losses" || detail::Fp8Gemms::is_entry(key) ||
                       (key.rfind("loss_scaler", 0) == 0 && key.size() > 11) ||
                       detail::StochasticRounding::is_entry(key);  // 8-bit state's: dropped without rounding
    TORCH_CHECK(known, "amp: unexpected entry '", key, "' in amp's state; was the archive written by "
                "amp::save_state?");
  }
  // Load into copies first, so a bad entry leaves every live scaler untouched.
  std::vector<internal::LossScaling> loaded;
  for (int i = 0; i < context->num_losses(); ++i) {
    torch::serialize::InputArchive scaler;
    TORCH_CHECK(archive.try_read("loss_scaler" + std::to_string(i), scaler), "amp: the state has "
                "no entry 'loss_scaler", i, "'.");
    loaded.push_back(context->scaler(i));
    loaded.back().load(scaler);
  }
  if (detail::Fp8Gemms* fp8 = context->fp8()) fp8->load(archive, *context->parameter_names());
  if (detail::StochasticRounding* rounding = context->rounding()) rounding->load(archive);
  for (int i = 0; i < context->num_losses(); ++i) context->scaler(i) = loaded[i];
}

}  // namespace amp
