// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Mixed precision inside a custom autograd function
/// (torch::autograd::Function<T>), as torch.amp's custom_fwd / custom_bwd.
///
/// custom_fwd, at the top of forward: records the thread's casting state for
/// backward. Given a dtype (cast_inputs), and when amp casts on this thread,
/// forward runs in that dtype: cast() converts its floating inputs and amp's
/// casts are off until forward returns. Where amp does not cast (not
/// initialized, O0, inside disable_casts) cast() returns its input unchanged.
///
/// custom_bwd, at the top of backward: backward runs with the casting state
/// forward ran with. amp never casts during backward otherwise, so a backward
/// whose forward ran under casts gets the dtypes it expects only with it.
///
/// ```
///   struct Fp32Matmul : torch::autograd::Function<Fp32Matmul> {
///     static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor a, at::Tensor b) {
///       amp::custom_fwd fwd(ctx, at::kFloat);  // float32 inside, even under O1
///       a = fwd.cast(a), b = fwd.cast(b);
///       ctx->save_for_backward({a, b});
///       return torch::mm(a, b);                // float32
///     }
///     static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
///                                                    torch::autograd::variable_list grads) {
///       amp::custom_bwd bwd(ctx);              // casts off, as in forward
///       auto saved = ctx->get_saved_variables();
///       return {grads[0].mm(saved[1].t()), saved[0].t().mm(grads[0])};
///     }
///   };
/// ```
///
/// The state travels in ctx->saved_data under keys starting with "amp.".
/// Errors (c10::Error): custom_fwd with a dtype that is not floating;
/// custom_bwd without a custom_fwd in forward, or when forward cast and amp
/// has been deinitialized since.
#pragma once

#include <amp/casting_scope.h>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>

namespace amp {

/// RAII, at the top of a custom autograd function's forward: records the
/// casting state for backward and, given a dtype, runs forward in it (see
/// custom_function.h).
class [[nodiscard]] custom_fwd {
 public:
  /// Saves this thread's casting state in `ctx` for custom_bwd. With
  /// `cast_inputs`, where amp casts on this thread, cast() converts to that
  /// dtype and amp's casts are off until this scope ends.
  explicit custom_fwd(torch::autograd::AutogradContext* ctx,
                      std::optional<c10::ScalarType> cast_inputs = std::nullopt);
  ~custom_fwd();
  custom_fwd(const custom_fwd&) = delete;
  custom_fwd& operator=(const custom_fwd&) = delete;

  /// `t` in the cast_inputs dtype when this forward casts its inputs and `t`
  /// is a floating tensor other than float64; `t` itself otherwise.
  at::Tensor cast(const at::Tensor& t) const;

 private:
  std::optional<c10::ScalarType> to_;
  std::optional<disable_casts> off_;
};

/// RAII, at the top of a custom autograd function's backward: backward runs
/// with the casting state its forward ran with (see custom_function.h).
class [[nodiscard]] custom_bwd {
 public:
  /// Restores, until this scope ends, the casting state custom_fwd saved in
  /// `ctx`.
  explicit custom_bwd(torch::autograd::AutogradContext* ctx);
  ~custom_bwd();
  custom_bwd(const custom_bwd&) = delete;
  custom_bwd& operator=(const custom_bwd&) = delete;

 private:
  std::optional<with_casting_state> state_;
  bool casts_;
};

}  // namespace amp
