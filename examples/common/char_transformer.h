// SPDX-License-Identifier: BSD-3-Clause
// A small character-level transformer language model (GPT-style): token and
// position embeddings, pre-norm blocks of causal multi-head attention
// (scaled_dot_product_attention, or its ops) and a GELU MLP, a final layer norm and a
// linear head (or the token embedding, tied). Each block may run under
// amp::recompute (whole, or in slices of the batch, or keeping its GEMMs'
// outputs), and runs of blocks around them (two levels).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace examples {

struct TransformerConfig {
  int64_t vocab = 256;
  int64_t context = 64;
  int64_t width = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  // Attention as one fused kernel (scaled_dot_product_attention: flash
  // attention, which keeps no sequence x sequence tensor for backward), or,
  // false, as its ops (PyTorch's math path: the scores and their softmax,
  // per head, kept for backward, as attention without a fused kernel keeps
  // them; what Megatron's selective recomputation was measured against).
  bool fused_attention = true;
  bool tied_head = false;  // logits from the token embedding's weight, no head of its own
  bool recompute = false;  // each block's activations recomputed in backward
  // With recompute, > 1: runs of this many blocks are recomputed as one as
  // well (two levels: forward keeps a run's input, the run's rerun keeps its
  // blocks' inputs). About sqrt(layers) keeps the fewest block inputs at
  // once - 2 sqrt(layers) instead of layers - for a third forward pass.
  int64_t recompute_run = 0;
  // With recompute, > 1: each block runs, and reruns, on this many slices of
  // the batch (amp::recompute_in_slices): its activations at once are a
  // slice's, for GEMMs of fewer rows.
  int64_t recompute_slices = 0;
  // With recompute: each block keeps its GEMMs' outputs for its rerun, which
  // computes only the rest (amp::Keep::gemm_outputs: selective recomputation).
  bool recompute_keep_gemms = false;
  // The loss through amp::linear_cross_entropy: the head's logits computed
  // and dropped chunk by chunk (what a large vocabulary needs).
  bool fused_loss = false;
  // With fused_loss, > 0: the vocabulary in windows of this many classes
  // (chunk_vocabulary: the weight gradient's float32 sum is a window's), and
  // chunks of this many tokens (chunk_tokens; 0 picks).
  int64_t loss_vocab_window = 0;
  int64_t loss_chunk_tokens = 0;
};

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const TransformerConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  int64_t heads;
  bool fused_attention;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct CharTransformerImpl : torch::nn::Module {
  explicit CharTransformerImpl(const TransformerConfig& c = {});
  // tokens [batch, time] int64 -> logits [batch, time, vocab]
  torch::Tensor forward(const torch::Tensor& tokens);
  // tokens -> the final norm's output [batch, time, width], what the head reads.
  torch::Tensor hidden(const torch::Tensor& tokens);
  // The mean cross-entropy of predicting targets [batch, time] from tokens:
  // through amp::linear_cross_entropy with config.fused_loss, else from the
  // float32 logits.
  torch::Tensor loss(const torch::Tensor& tokens, const torch::Tensor& targets);
  // Blocks [begin, end) on x, each recomputed when config.recompute is set.
  torch::Tensor run_blocks(size_t begin, size_t end, torch::Tensor x);
  TransformerConfig config;
  torch::nn::Embedding token{nullptr}, position{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(CharTransformer);

// TransformerConfig::fused_attention from the examples' --attention flag:
// "fused" true, "math" false; another name throws std::invalid_argument.
bool fused_attention_named(const std::string& name);

// Reads every regular file of Debian's /usr/share/common-licenses (package
// base-files, present on every Debian system) as one byte string, or the
// files under `dir` when given.
std::string read_license_corpus(const std::string& dir = "/usr/share/common-licenses");

// The corpus as tokens of a `vocab`-way model: its bytes for 256; for a
// larger vocabulary each pair of bytes is one token, (first * 256 + second)
// mod vocab (50304 folds 65536 pairs: 15232 share an id), so a real text
// exercises a GPT-2-sized output layer without a tokenizer. int64 [tokens].
torch::Tensor corpus_tokens(const std::string& text, int64_t vocab);

}  // namespace examples
