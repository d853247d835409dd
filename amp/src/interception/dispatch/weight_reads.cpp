// SPDX-License-Identifier: BSD-3-Clause
#include "interception/dispatch/weight_reads.h"

#include "interception/dispatch/interceptor.h"
#include "model/model_weights.h"

#include <ATen/Operators.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <array>
#include <string>

namespace amp::detail {
namespace {

// Every watched op reads its weight as its first argument, `self`.
struct SelfArg {
  const at::Tensor& self;
  template <class Fn>
  void for_each_tensor(Fn&& fn) const {
    fn(self, /*in_list=*/false);
  }
};

template <class Op, class Signature = typename Op::schema>
class WeightReadKernel;

template <class Op, class Ret, class Self, class... Rest>
class WeightReadKernel<Op, Ret(Self, Rest...)> {
 public:
  explicit WeightReadKernel(const DeviceCasting* casting)
      : weights_(casting->weights),
        reentry_keys_(casting->autocast_key),
        below_(c10::DispatchKeySet::FULL_AFTER, casting->autocast_key) {}

  Ret operator()(c10::DispatchKeySet keys, Self self, Rest... rest) const {
    // Also keeps the views an op takes inside itself (slice's as_strided) off amp.
    c10::impl::ExcludeDispatchKeyGuard no_reentry(reentry_keys_);
    if (C10_UNLIKELY(weights_->pending())) weights_->on_op(SelfArg{self}, /*weight_read=*/true);
    return Op::redispatch(keys & below_, self, std::move(rest)...);  // SymInts moved, not copied
  }

 private:
  ModelWeights* weights_;
  c10::DispatchKeySet reentry_keys_;
  c10::DispatchKeySet below_;
};

struct WatchedOp {
  c10::OperatorName name;
  torch::CppFunction (*make)(const DeviceCasting*);
};

template <class Op>
WatchedOp watched() {
  return {c10::OperatorName(Op::name, Op::overload_name),
          [](const DeviceCasting* casting) { return torch::CppFunction(WeightReadKernel<Op>(casting)); }};
}

// ATen's views with a kernel of their own (its composite views - narrow,
// chunk, reshape, flatten, movedim, mT, expand_as, ... - run through these),
// less detach (it records no graph) and those of sparse, nested, complex or
// dual tensors; then the indexed reads (take_along_dim runs through gather).
const std::array<WatchedOp, 23>& watched_ops() {
  static const std::array<WatchedOp, 23> ops = {
      watched<at::_ops::view>(),          watched<at::_ops::_reshape_alias>(),
      watched<at::_ops::as_strided>(),    watched<at::_ops::slice_Tensor>(),
      watched<at::_ops::select_int>(),    watched<at::_ops::t>(),
      watched<at::_ops::transpose_int>(), watched<at::_ops::permute>(),
      watched<at::_ops::expand>(),        watched<at::_ops::unsqueeze>(),
      watched<at::_ops::squeeze>(),       watched<at::_ops::squeeze_dim>(),
      watched<at::_ops::squeeze_dims>(),  watched<at::_ops::diagonal>(),
      watched<at::_ops::unfold>(),        watched<at::_ops::split_Tensor>(),
      watched<at::_ops::split_with_sizes>(), watched<at::_ops::unbind_int>(),
      watched<at::_ops::alias>(),         watched<at::_ops::index_select>(),
      watched<at::_ops::index_Tensor>(),  watched<at::_ops::gather>(),
      watched<at::_ops::take>(),
  };
  return ops;
}

}  // namespace

bool is_weight_read(const c10::OperatorName& op) {
  for (const WatchedOp& w : watched_ops()) {
    if (w.name == op) return true;
  }
  return false;
}

void watch_weight_reads(torch::Library& library, const DeviceCasting& casting,
                        const std::function<bool(const c10::OperatorName&)>& has_kernel) {
  for (const WatchedOp& w : watched_ops()) {
    if (!has_kernel(w.name)) library.impl(to_string(w.name).c_str(), w.make(&casting));
  }
}

}  // namespace amp::detail
