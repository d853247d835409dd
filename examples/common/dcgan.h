// SPDX-License-Identifier: BSD-3-Clause
// DCGAN-style generator and discriminator for 28x28 grayscale images.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace examples {

inline constexpr int64_t kLatent = 64;

struct GeneratorImpl : torch::nn::Module {
  GeneratorImpl();
  torch::Tensor forward(const torch::Tensor& z);  // [N, kLatent] -> [N, 1, 28, 28] in [-1, 1]
  torch::nn::Linear project{nullptr};
  torch::nn::BatchNorm2d bn0{nullptr}, bn1{nullptr};
  torch::nn::ConvTranspose2d up1{nullptr}, up2{nullptr};
};
TORCH_MODULE(Generator);

struct DiscriminatorImpl : torch::nn::Module {
  DiscriminatorImpl();
  torch::Tensor forward(const torch::Tensor& images);  // -> [N] logits
  torch::nn::Conv2d down1{nullptr}, down2{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear classify{nullptr};
};
TORCH_MODULE(Discriminator);

}  // namespace examples
