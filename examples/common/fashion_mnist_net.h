// SPDX-License-Identifier: BSD-3-Clause
// The Fashion-MNIST CNN shared by the example, the precision report and the
// benchmarks: conv-BN-ReLU-pool twice, then two linear layers.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace examples {

struct FashionNetImpl : torch::nn::Module {
  FashionNetImpl();
  torch::Tensor forward(torch::Tensor x);

  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(FashionNet);

}  // namespace examples
