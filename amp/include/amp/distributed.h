// Data-parallel training with amp over LibTorch's c10d process groups.
//
// Every rank must skip the same steps and keep the same loss scale, or the
// replicas drift apart. Give amp the process group and it all-reduces (MAX)
// each step's overflow flag before updating the scale, as Megatron-LM does:
//
//   amp::Options options = amp::O2;
//   options.reduce_overflow = amp::overflow_all_reduce(process_group);  // Gloo, NCCL, ...
//   std::tie(model, optimizer) = amp::initialize(model, optimizer, options);
//   ...
//   {
//     amp::scale_loss scaled(loss, optimizer);
//     scaled.backward();
//   }
//   all_reduce_mean(grads_of(amp::master_params(*optimizer)));  // your DDP code, as usual
//   optimizer->step();
//
// Where to reduce gradients: after the guard and before step() (unscaled;
// at O2 the fp32 master gradients), or inside the guard after backward()
// (the model's scaled gradients, as DDP's hooks do; the guard then unscales
// and checks the reduced ones). Both keep ranks identical. amp only reduces
// the one-element overflow flag; it never touches the gradients' traffic.
// With NCCL the flag is a CUDA tensor, with Gloo a CPU (or CUDA) tensor.
//
// Errors: a null process group.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <functional>

namespace c10d {
class Backend;
}  // namespace c10d

namespace amp {

// `group` is a c10d backend: ProcessGroupGloo, ProcessGroupNCCL, ... (for a
// c10d::ProcessGroup pass its backend, e.g. group->getDefaultBackend()).
std::function<void(at::Tensor&)> overflow_all_reduce(c10::intrusive_ptr<c10d::Backend> group);

}  // namespace amp
