// SPDX-License-Identifier: BSD-3-Clause
#include "distributed/replicas.h"

#include <ATen/ATen.h>

#include <map>

namespace amp::detail {

void broadcast_from_rank0(const std::vector<torch::nn::Module*>& models, c10d::Backend& group) {
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (torch::nn::Module* model : models) {
    for (const at::Tensor& p : model->parameters()) by_dtype[p.scalar_type()].push_back(p);
    for (const at::Tensor& b : model->buffers()) by_dtype[b.scalar_type()].push_back(b);
  }
  at::NoGradGuard no_grad;
  for (auto& [dtype, tensors] : by_dtype) {
    std::vector<at::Tensor> flat_parts;
    for (const at::Tensor& t : tensors) flat_parts.push_back(t.detach().reshape(-1));
    std::vector<at::Tensor> flat{at::cat(flat_parts)};
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    group.broadcast(flat, options)->wait();
    int64_t offset = 0;
    for (const at::Tensor& t : tensors) {
      t.detach().copy_(flat[0].narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

uint64_t rank0_seed(uint64_t seed, c10d::Backend& group) {
  // NCCL moves only CUDA tensors.
  const c10::Device device = group.getBackendName() == "nccl" ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  std::vector<at::Tensor> value{at::full({1}, static_cast<int64_t>(seed), at::TensorOptions(device).dtype(at::kLong))};
  c10d::BroadcastOptions options;
  options.rootRank = 0;
  group.broadcast(value, options)->wait();
  return static_cast<uint64_t>(value[0].item<int64_t>());
}

}  // namespace amp::detail
