// SPDX-License-Identifier: BSD-3-Clause
// Private: the boxed arguments of one call (the top entries of a dispatcher
// stack), as cast_decision.h and model_weights.h view a call's tensors.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>

namespace amp::detail {

class BoxedArgs {
 public:
  explicit BoxedArgs(c10::ArrayRef<c10::IValue> args) : args_(args) {}

  template <class Fn>
  void for_each_tensor(Fn&& fn) const {
    for (const c10::IValue& arg : args_) {
      if (arg.isTensor()) {
        fn(arg.toTensor(), /*in_list=*/false);
      } else if (arg.isTensorList()) {
        for (const at::Tensor& t : arg.toTensorVector()) fn(t, /*in_list=*/true);
      }
    }
  }
  const at::Tensor* first_tensor() const {
    return !args_.empty() && args_.front().isTensor() ? &args_.front().toTensor() : nullptr;
  }

 private:
  c10::ArrayRef<c10::IValue> args_;
};

}  // namespace amp::detail
