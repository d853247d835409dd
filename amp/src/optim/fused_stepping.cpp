#include "optim/fused_stepping.h"

#include "optim/optimizer_kinds.h"
#include "support/host_read.h"
#include "support/trace_range.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

namespace amp::optim::internal {
namespace {

bool kernel_ready(const at::Tensor& t, const at::Tensor& param, c10::ScalarType dtype) {
  return !t.defined() || (t.layout() == at::kStrided && t.is_contiguous() && t.scalar_type() == dtype &&
                          t.device() == param.device() && t.sizes() == param.sizes());
}

// At most this many elements of parameters are widened to float32 at once
// (UpdateRounding): 4 MiB per widened list, a few per step - a transient
// that stays small beside the bytes O6 saves.
constexpr int64_t kChunkElements = int64_t{1} << 20;

}  // namespace

void step_widened(const std::vector<const std::vector<at::Tensor>*>& columns, const std::vector<bool>& written,
                  detail::StochasticRounding& rounder,
                  const std::function<void(const std::vector<std::vector<at::Tensor>>&)>& kernel) {
  const std::vector<at::Tensor>& params = *columns[0];
  for (size_t begin = 0; begin < params.size();) {
    size_t end = begin;
    for (int64_t elements = 0; end < params.size() && (end == begin || elements + params[end].numel() <= kChunkElements);
         ++end) {
      elements += params[end].numel();
    }
    std::vector<std::vector<at::Tensor>> wide(columns.size());
    for (size_t c = 0; c < columns.size(); ++c) {
      if (columns[c]->empty()) continue;
      for (size_t i = begin; i < end; ++i) {
        const at::Tensor& t = (*columns[c])[i];
        wide[c].push_back(t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t);
      }
    }
    kernel(wide);
    for (size_t c = 0; c < columns.size(); ++c) {
      if (!written[c] || columns[c]->empty()) continue;
      for (size_t i = begin; i < end; ++i) {
        const at::Tensor& t = (*columns[c])[i];
        if (t.scalar_type() == at::kBFloat16) rounder.round_into(wide[c][i - begin], t);
      }
    }
    begin = end;
  }
}

// ---- FusedStepping ------------------------------------------------------------

c10::ScalarType state_dtype_of(const at::Tensor& p, const UpdateRounding* rounding) {
  return detail::kept_state_dtype(p.scalar_type(), rounding ? std::optional(rounding->state_dtype) : std::nullopt);
}

bool FusedStepping::suits(const torch::optim::Optimizer& optimizer, const UpdateRounding* rounding) const {
  std::optional<c10::Device> device;
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      // ATen's fused kernels take the four floating dtypes; float16 and
      // bfloat16 parameters (O3) keep their state in their own dtype, as
      // LibTorch's step creates it, where the kernel steps them; O6's are
      // stepped widened to float32.
      const c10::ScalarType dtype = p.scalar_type();
      const bool reduced = dtype == at::kHalf || dtype == at::kBFloat16;
      const bool rounded = rounding != nullptr && dtype == at::kBFloat16;
      if (dtype != at::kFloat && dtype != at::kDouble && !reduced) return false;
      if (reduced && !rounded && !kernel_.steps_low_precision_on_cpu() && p.is_cpu()) return false;
      if (!(p.is_cpu() || p.is_cuda()) || !p.is_contiguous() || !kernel_ready(grad, p, p.scalar_type())) return false;
      if (device && *device != p.device()) return false;
      device = p.device();
      auto s = optimizer.state().find(p.unsafeGetTensorImpl());
      if (s == optimizer.state().end()) continue;
      int64_t step = 0;
      const std::vector<detail::StateTensor> tensors = detail::state_tensors(*s->second, step);
      if (tensors.empty()) return false;  // state of another kind
      const c10::ScalarType state_dtype = state_dtype_of(p, rounding);
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (kernel_.needs_state(group.options(), i) && (!tensors[i].value.defined() || !kernel_ready(tensors[i].value, p, state_dtype))) return false;
      }
    }
  }
  return true;
}

FusedAttempt FusedStepping::step(torch::optim::Optimizer& optimizer, const at::Tensor& found_inf,
                                  const UpdateRounding* rounding) {
  AMP_TRACE_RANGE("amp::fused step");
  at::NoGradGuard no_grad;
  FusedAttempt attempt;
  if (rounding != nullptr) rounding->rounder->next_step();
  auto device_step = [this](void* key, int64_t host, const at::Tensor& param) -> at::Tensor& {
    at::Tensor& count = device_steps_[key];
    if (!count.defined()) count = at::full({}, static_cast<double>(host), param.options().dtype(at::kFloat));
    return count;
  };
  for (auto& group : optimizer.param_groups()) {
    GroupStep step{group, optimizer.state(), found_inf, rounding, attempt, device_step};
    kernel_.step(step);
  }
  return attempt;
}

void FusedStepping::settle(const FusedAttempt& attempt, bool skipped, StateMap& state) {
  if (skipped) {  // LibTorch creates no state on a step it does not take
    for (void* key : attempt.created) {
      state.erase(key);
      device_steps_.erase(key);
    }
    return;
  }
  for (void* key : attempt.stepped) {
    if (auto it = state.find(key); it != state.end()) detail::count_step(*it->second);
  }
}

bool FusedStepping::holds_all_state(const torch::optim::Optimizer& optimizer) const {
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      void* key = p.unsafeGetTensorImpl();
      if (!optimizer.state().count(key)) return false;
      if (kernel_.counts_steps() && !device_steps_.count(key)) return false;
    }
  }
  return true;
}

void FusedStepping::adopt_device_counts(StateMap& state) {
  std::vector<void*> keys;
  std::vector<at::Tensor> counts;
  for (const auto& [key, count] : device_steps_) {
    if (!state.count(key)) continue;
    keys.push_back(key);
    counts.push_back(count);
  }
  if (keys.empty()) return;
  const at::Tensor host = at::stack(counts).to(at::kDouble).cpu();  // one host sync
  detail::count_host_read();
  for (size_t i = 0; i < keys.size(); ++i) {
    detail::set_step_count(*state.at(keys[i]), static_cast<int64_t>(host[i].item<double>()));
  }
}

}  // namespace amp::optim::internal
