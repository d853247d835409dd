// SPDX-License-Identifier: BSD-3-Clause
// The model of the fuzzer's set-up (fuzz_loaders.cpp), which wrote the
// corpus and tests/data/format1: versions_test.cpp loads those files into it.
#pragma once

#include <torch/torch.h>

namespace amp::fuzz {

struct FuzzNetImpl : torch::nn::Module {
  FuzzNetImpl()
      : a(register_module("a", torch::nn::Linear(4, 6))),
        bn(register_module("bn", torch::nn::BatchNorm1d(6))),
        b(register_module("b", torch::nn::Linear(6, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(bn(a(x)))); }
  torch::nn::Linear a;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear b;
};
TORCH_MODULE(FuzzNet);

}  // namespace amp::fuzz
