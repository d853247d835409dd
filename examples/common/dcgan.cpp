// SPDX-License-Identifier: BSD-3-Clause
#include "dcgan.h"

#include <ATen/ATen.h>

namespace examples {

GeneratorImpl::GeneratorImpl() {
  project = register_module("project", torch::nn::Linear(kLatent, 128 * 7 * 7));
  bn0 = register_module("bn0", torch::nn::BatchNorm2d(128));
  up1 = register_module("up1", torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(128, 64, 4).stride(2).padding(1)));
  bn1 = register_module("bn1", torch::nn::BatchNorm2d(64));
  up2 = register_module("up2", torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(64, 1, 4).stride(2).padding(1)));
}

torch::Tensor GeneratorImpl::forward(const torch::Tensor& z) {
  auto x = at::relu(bn0(project(z).view({-1, 128, 7, 7})));
  x = at::relu(bn1(up1(x)));
  return at::tanh(up2(x));
}

DiscriminatorImpl::DiscriminatorImpl() {
  down1 = register_module("down1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 64, 4).stride(2).padding(1)));
  down2 = register_module("down2", torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 128, 4).stride(2).padding(1)));
  bn = register_module("bn", torch::nn::BatchNorm2d(128));
  classify = register_module("classify", torch::nn::Linear(128 * 7 * 7, 1));
}

torch::Tensor DiscriminatorImpl::forward(const torch::Tensor& images) {
  auto x = at::leaky_relu(down1(images), 0.2);
  x = at::leaky_relu(bn(down2(x)), 0.2);
  return classify(x.flatten(1)).squeeze(1);
}

}  // namespace examples
