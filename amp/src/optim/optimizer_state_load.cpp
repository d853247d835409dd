// SPDX-License-Identifier: BSD-3-Clause
#include "optim/optimizer_state_load.h"

#include "optim/eight_bit_state.h"
#include "optim/optimizer_kinds.h"

#include <c10/util/Exception.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

namespace amp::detail {

void convert_state(torch::optim::Optimizer& optimizer, const StateDtype& dtype) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      int64_t step = 0;
      std::vector<StateTensor> tensors = state_tensors(*it->second, step);
      bool converted = false;
      for (StateTensor& t : tensors) {
        const at::ScalarType kept = dtype ? dtype(p) : p.scalar_type();
        const bool packed = is_packed_state(t.value);
        if (!t.value.defined() || !(packed || (dtype && t.value.is_floating_point()))) continue;
        if (packed ? kept == at::kByte : t.value.scalar_type() == kept) continue;
        const bool non_negative = non_negative_state(t.name);
        t.value = state_kept_as(state_values(t.value, p, non_negative), kept, non_negative);
        converted = true;
      }
      if (converted) it->second = make_state(group.options(), tensors, step);
    }
  }
}

namespace {

std::string kept_name(at::ScalarType dtype, const at::Tensor& p) {
  if (dtype != at::kByte) return c10::toString(dtype);
  return "8-bit: Byte[" + std::to_string(packed_blocks(p.numel())) + ", " + std::to_string(kPackedRow) + "]";
}

}  // namespace

void check_state_fits_params(const torch::optim::Optimizer& optimizer, const StateDtype& dtype) {
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
          const at::ScalarType expected = dtype ? dtype(p) : p.scalar_type();
          const bool fits = expected == at::kByte ? packs(t.value, p)
                                                  : t.value.sizes() == p.sizes() && t.value.scalar_type() == expected &&
                                                        t.value.device() == p.device();
          TORCH_CHECK(fits,
                      "the state '", t.name, "' of parameter ", index, " is ", t.value.scalar_type(), t.value.sizes(),
                      " on ", t.value.device(), " but the parameter is ", p.scalar_type(), p.sizes(), " on ",
                      p.device(), expected == p.scalar_type() ? "" : " (its state " + kept_name(expected, p) + ")");
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
                          const std::string& before, const StateDtype& dtype) {
  try {
    optimizer.load(archive);
    convert_state(optimizer, dtype);
    check_state_fits_params(optimizer, dtype);
  } catch (const std::exception& e) {
    restore_state_bytes(optimizer, before);
    TORCH_CHECK(false, "amp: cannot load the optimizer's state; nothing was changed. Was it saved from "
                "the same model and optimizer? Cause: ", message_of(e));
  }
}

}  // namespace amp::detail
