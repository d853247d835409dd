#include "persistence/optimizer_state_load.h"

#include "step/optimizer_kinds.h"

#include <c10/util/Exception.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

namespace amp::detail {

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

std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

std::string state_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive saved;
  optimizer.save(saved);
  std::ostringstream bytes;
  saved.save_to(bytes);
  return bytes.str();
}

void restore_state_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive saved;
  saved.load_from(in);
  optimizer.state().clear();
  optimizer.load(saved);
}

void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive,
                          const std::string& before) {
  try {
    optimizer.load(archive);
    check_state_fits_params(optimizer);
  } catch (const std::exception& e) {
    restore_state_bytes(optimizer, before);
    TORCH_CHECK(false, "amp: cannot load the optimizer's state; nothing was changed. Was it saved from "
                "the same model and optimizer? Cause: ", message_of(e));
  }
}

}  // namespace amp::detail
