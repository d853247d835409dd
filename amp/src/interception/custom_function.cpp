// SPDX-License-Identifier: BSD-3-Clause
#include <amp/custom_function.h>

#include "interception/dispatch/cast.h"

#include <c10/util/Exception.h>

namespace amp {
namespace {

constexpr const char* kCasts = "amp.casts";
constexpr const char* kCpuDtype = "amp.cpu_dtype";
constexpr const char* kCudaDtype = "amp.cuda_dtype";
constexpr const char* kCache = "amp.cache";

}  // namespace

custom_fwd::custom_fwd(torch::autograd::AutogradContext* ctx, std::optional<c10::ScalarType> cast_inputs) {
  TORCH_CHECK(!cast_inputs || c10::isFloatingType(*cast_inputs), "amp: custom_fwd casts inputs to a "
              "floating dtype (float32, float16, bfloat16), got ", *cast_inputs, ".");
  if (cast_inputs && CastingState::current().casts()) {
    to_ = cast_inputs;
    off_.emplace();
  }
  const CastingState forward = CastingState::current();  // what forward runs with
  ctx->saved_data[kCasts] = forward.casts();
  ctx->saved_data[kCpuDtype] = static_cast<int64_t>(forward.dtype(c10::DeviceType::CPU));
  ctx->saved_data[kCudaDtype] = static_cast<int64_t>(forward.dtype(c10::DeviceType::CUDA));
  ctx->saved_data[kCache] = forward.cache_enabled();
}

custom_fwd::~custom_fwd() = default;

at::Tensor custom_fwd::cast(const at::Tensor& t) const {
  if (!to_ || !t.defined() || !t.is_floating_point() || t.scalar_type() == at::kDouble) return t;
  return t.to(*to_);
}

custom_bwd::custom_bwd(torch::autograd::AutogradContext* ctx) {
  auto it = ctx->saved_data.find(kCasts);
  TORCH_CHECK(it != ctx->saved_data.end(), "amp: custom_bwd found no casting state from forward; "
              "open an amp::custom_fwd at the top of this function's forward.");
  const CastingState forward(it->second.toBool(),
                             static_cast<c10::ScalarType>(ctx->saved_data.at(kCpuDtype).toInt()),
                             static_cast<c10::ScalarType>(ctx->saved_data.at(kCudaDtype).toInt()),
                             ctx->saved_data.at(kCache).toBool());
  state_.emplace(forward);
  casts_ = forward.casts();
  if (casts_) detail::allow_casts_in_backward(true);
}

custom_bwd::~custom_bwd() {
  if (casts_) detail::allow_casts_in_backward(false);
}

}  // namespace amp
