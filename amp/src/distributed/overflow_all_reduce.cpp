// SPDX-License-Identifier: BSD-3-Clause
#include <amp/distributed.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace amp {

std::function<void(at::Tensor&)> overflow_all_reduce(c10::intrusive_ptr<c10d::Backend> group) {
  TORCH_CHECK(group, "amp: overflow_all_reduce needs a process group, got null.");
  return [group](at::Tensor& found_inf) {
    std::vector<at::Tensor> flag{found_inf};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MAX;
    group->allreduce(flag, options)->wait();
  };
}

}  // namespace amp
