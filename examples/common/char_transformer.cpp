// SPDX-License-Identifier: BSD-3-Clause
#include "char_transformer.h"

#include <amp/linear_cross_entropy.h>
#include <amp/recompute.h>
#include <amp/selective_recompute.h>

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace examples {

BlockImpl::BlockImpl(const TransformerConfig& c) : heads(c.heads), fused_attention(c.fused_attention) {
  norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
  norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
  qkv = register_module("qkv", torch::nn::Linear(c.width, 3 * c.width));
  proj = register_module("proj", torch::nn::Linear(c.width, c.width));
  up = register_module("up", torch::nn::Linear(c.width, 4 * c.width));
  down = register_module("down", torch::nn::Linear(4 * c.width, c.width));
}

namespace {

// at::linear, as Python's nn.Linear calls it: LibTorch's nn::Linear::forward
// (torch::nn::functional::linear) runs a 3-D input as matmul and an in-place
// bias add, where at::linear folds the batch into one addmm (the bias added
// by the GEMM) - fewer kernels forward and backward, on the CPU and on CUDA.
torch::Tensor linear(const torch::nn::Linear& layer, const torch::Tensor& x) {
  return at::linear(x, layer->weight, layer->bias);
}

}  // namespace

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  const int64_t batch = x.size(0), time = x.size(1), width = x.size(2);
  auto split = linear(qkv, norm1(x)).view({batch, time, 3, heads, width / heads}).permute({2, 0, 3, 1, 4});
  auto attended =
      fused_attention
          ? at::scaled_dot_product_attention(split[0], split[1], split[2], {}, 0.0, /*is_causal=*/true)
          : std::get<0>(at::_scaled_dot_product_attention_math(split[0], split[1], split[2], {}, 0.0, /*is_causal=*/true));
  auto h = x + linear(proj, attended.transpose(1, 2).reshape({batch, time, width}));
  return h + linear(down, at::gelu(linear(up, norm2(h))));
}

CharTransformerImpl::CharTransformerImpl(const TransformerConfig& c) : config(c) {
  token = register_module("token", torch::nn::Embedding(c.vocab, c.width));
  position = register_module("position", torch::nn::Embedding(c.context, c.width));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c));
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
  if (!c.tied_head) head = register_module("head", torch::nn::Linear(c.width, c.vocab));
  // A tied head reads the embedding as output weights: small, as GPT-2's
  // initialization, or the first logits are large and the loss starts far off.
  if (c.tied_head) torch::nn::init::normal_(token->weight, 0.0, 0.02);
}

torch::Tensor CharTransformerImpl::run_blocks(size_t begin, size_t end, torch::Tensor x) {
  for (size_t i = begin; i < end; ++i) {
    auto block = blocks->ptr<BlockImpl>(i);
    auto run = [block](const torch::Tensor& in) { return block->forward(in); };
    if (!config.recompute) {
      x = block->forward(x);
    } else {
      const amp::Keep keep = config.recompute_keep_gemms ? amp::Keep::gemm_outputs() : amp::Keep::nothing();
      x = config.recompute_slices > 1 ? amp::recompute_in_slices(config.recompute_slices, run, x, keep)
                                      : amp::recompute(keep, run, x);
    }
  }
  return x;
}

torch::Tensor CharTransformerImpl::forward(const torch::Tensor& tokens) {
  const torch::Tensor x = hidden(tokens);
  return config.tied_head ? at::linear(x, token->weight) : linear(head, x);
}

torch::Tensor CharTransformerImpl::loss(const torch::Tensor& tokens, const torch::Tensor& targets) {
  if (config.fused_loss) {
    return amp::linear_cross_entropy(hidden(tokens), config.tied_head ? token->weight : head->weight,
                                     config.tied_head ? torch::Tensor() : head->bias, targets, {},
                                     config.loss_chunk_tokens, config.loss_vocab_window);
  }
  return at::cross_entropy_loss(forward(tokens).to(torch::kFloat).reshape({-1, config.vocab}), targets.reshape({-1}));
}

torch::Tensor CharTransformerImpl::hidden(const torch::Tensor& tokens) {
  auto x = token(tokens) + position(at::arange(tokens.size(1), tokens.options()));
  const size_t layers = blocks->size();
  if (config.recompute && config.recompute_run > 1) {
    auto self = std::static_pointer_cast<CharTransformerImpl>(shared_from_this());  // lives until backward
    for (size_t begin = 0, run = config.recompute_run; begin < layers; begin += run) {
      const size_t end = std::min(begin + run, layers);
      x = amp::recompute([self, begin, end](const torch::Tensor& in) { return self->run_blocks(begin, end, in); }, x);
    }
  } else {
    x = run_blocks(0, layers, x);
  }
  return norm(x);
}

bool fused_attention_named(const std::string& name) {
  if (name != "fused" && name != "math") {
    throw std::invalid_argument("--attention must be fused or math, not '" + name + "'");
  }
  return name == "fused";
}

std::string read_license_corpus(const std::string& dir) {
  std::vector<std::filesystem::path> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.is_regular_file() && !entry.is_symlink()) files.push_back(entry.path());
  }
  if (files.empty()) {
    throw std::runtime_error("no text files in " + dir +
                             " (Debian's base-files package provides /usr/share/common-licenses)");
  }
  std::sort(files.begin(), files.end());
  std::ostringstream text;
  for (const auto& f : files) text << std::ifstream(f).rdbuf() << "\n";
  return text.str();
}

torch::Tensor corpus_tokens(const std::string& text, int64_t vocab) {
  auto bytes = torch::empty({int64_t(text.size())}, torch::kByte);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  const torch::Tensor b = bytes.to(torch::kLong);
  if (vocab == 256) return b;
  const int64_t pairs = b.size(0) / 2;
  return (b.slice(0, 0, 2 * pairs, 2) * 256 + b.slice(0, 1, 2 * pairs, 2)).remainder(vocab);
}

}  // namespace examples
