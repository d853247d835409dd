// SPDX-License-Identifier: BSD-3-Clause
#include "fashion_mnist_net.h"

#include <ATen/ATen.h>

namespace examples {

FashionNetImpl::FashionNetImpl()
    : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)))),
      bn1(register_module("bn1", torch::nn::BatchNorm2d(32))),
      conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)))),
      bn2(register_module("bn2", torch::nn::BatchNorm2d(64))),
      fc1(register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128))),
      fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}

torch::Tensor FashionNetImpl::forward(torch::Tensor x) {
  x = at::max_pool2d(at::relu(bn1(conv1(x))), {2, 2});
  x = at::max_pool2d(at::relu(bn2(conv2(x))), {2, 2});
  return fc2(at::relu(fc1(x.flatten(1))));
}

}  // namespace examples
