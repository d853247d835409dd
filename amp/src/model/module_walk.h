// SPDX-License-Identifier: BSD-3-Clause
// Private: visiting a model's modules, including a model held by value.
// torch::nn::Module::named_modules(include_self=true) needs the model in a
// std::shared_ptr; programs that follow LibTorch's MNIST example hold it on
// the stack.
#pragma once

#include <torch/nn/module.h>

#include <string>

namespace amp::detail {

// fn(name, module) for `model` (name "") and every submodule ("conv",
// "block.fc", ...), parents first.
template <class Fn>
void for_each_module(torch::nn::Module& model, Fn&& fn) {
  fn(std::string(), model);
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    fn(item.key(), *item.value());
  }
}

}  // namespace amp::detail
