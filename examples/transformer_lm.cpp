// SPDX-License-Identifier: BSD-3-Clause
// A character-level transformer language model trained with amp on the
// license texts of Debian's base-files package (/usr/share/common-licenses),
// then sampled.
//
//   transformer_lm --opt_level=O2 --steps=500
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>
#include <amp/measured_policy.h>

#include "common/char_transformer.h"
#include "common/diagnostics.h"
#include "common/graphed_step.h"
#include "common/step_csv.h"
#include "common/step_trace.h"
#include "common/run_setup.h"

#include <absl/flags/flag.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>

ABSL_FLAG(std::string, opt_level, "O1", "amp opt level: O0..O6, or O5+fp8 (O5 with linear layers in float8)");
ABSL_FLAG(std::string, dtype, "", "low-precision dtype: fp16 or bf16");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda");
ABSL_FLAG(int, steps, 500, "training steps");
ABSL_FLAG(int, batch_size, 32, "sequences per batch");
ABSL_FLAG(int, context, 64, "characters per sequence");
ABSL_FLAG(double, lr, 3e-3, "AdamW learning rate");
ABSL_FLAG(std::string, optimizer, "",
          "libtorch (torch::optim::AdamW) or fused (amp::optim::FusedAdamW); default: fused where only it "
          "applies (O6's stochastic rounding, 8-bit state, the step in backward), libtorch otherwise");
ABSL_FLAG(int, layers, 2, "transformer blocks");
ABSL_FLAG(int, width, 64, "model width");
ABSL_FLAG(int, heads, 4, "attention heads (a divisor of --width)");
ABSL_FLAG(int, vocab, 256, "output classes: 256 (bytes), or more from byte pairs (50304: GPT-2's vocabulary size)");
ABSL_FLAG(bool, fused_loss, false, "the head and its loss through amp::linear_cross_entropy: logits never held whole");
ABSL_FLAG(int, loss_vocab_window, 0, "with --fused_loss, > 0: the vocabulary in windows of this many classes "
          "(chunk_vocabulary: less memory for a large vocabulary, one more GEMM a chunk)");
ABSL_FLAG(int, loss_chunk_tokens, 0, "with --fused_loss: tokens a chunk of the loss holds (0 picks: float32 logits "
          "of at most 32 MiB)");
ABSL_FLAG(std::string, attention, "fused",
          "fused (scaled_dot_product_attention's fused kernel) or math (its ops, which keep each head's scores and "
          "softmax for backward: what --recompute_keep_gemms drops)");
ABSL_FLAG(bool, recompute, false, "recompute each block's activations in backward (amp::recompute)");
ABSL_FLAG(int, recompute_run, 0, "with --recompute, > 1: runs of this many blocks recomputed as one too (two levels; "
          "about sqrt(layers) keeps the fewest block inputs)");
ABSL_FLAG(int, recompute_slices, 0, "with --recompute, > 1: each block run and rerun in this many slices of the batch "
          "(amp::recompute_in_slices: a slice's activations at once)");
ABSL_FLAG(bool, recompute_keep_gemms, false, "with --recompute: each block keeps its GEMMs' outputs for its rerun, "
          "which computes only the rest (selective recomputation: amp::Keep::gemm_outputs)");
ABSL_FLAG(bool, eight_bit_state, false, "keep AdamW's moments in 8 bits (optimizer_state_dtype uint8; fused optimizer)");
ABSL_FLAG(bool, step_in_backward, false,
          "apply each update during backward and free its gradient (O4/O6, fused optimizer); no gradient clipping");
ABSL_FLAG(int, seed, 0, "random seed");
ABSL_FLAG(bool, cuda_graph, false,
          "capture the whole training step in a CUDA graph after 3 warm-up steps and replay it (--device=cuda, "
          "amp's fused optimizer)");
ABSL_FLAG(std::string, corpus_dir, "/usr/share/common-licenses", "directory of text files to learn");
ABSL_FLAG(int, sample_chars, 200, "characters to sample after training");
ABSL_FLAG(int, verbosity, 1, "amp verbosity");
ABSL_FLAG(std::string, csv, "", "write step,loss,loss_scale per step to this CSV file");
ABSL_FLAG(std::string, trace, "", "write a Chrome trace of training steps 3-5 (LibTorch's profiler) to this file");
ABSL_FLAG(bool, keep_cpu_memory, true,
          "on the CPU, reuse the memory the step before freed instead of faulting it in again "
          "(amp::Options::keep_cpu_memory)");
ABSL_FLAG(bool, measured_policy, false,
          "run GEMMs and convolutions in float32 where measured faster at their shape (amp::Options::measured_policy)");
ABSL_FLAG(std::string, measured_policy_file, "",
          "with --measured_policy: load the policy's table from this file if it exists (no measuring), save it "
          "there after training");
ABSL_FLAG(std::string, inject_non_finite, "",
          "'<module>:<step>' (e.g. 'fc1:100'): make that module's first weight inf for that step, and print "
          "what amp's overflow provenance says of it");

namespace {

std::string sample(examples::CharTransformer& model, c10::Device device, const std::string& prompt, int count) {
  torch::NoGradGuard no_grad;
  model->eval();
  std::string text = prompt;
  const int64_t context = model->config.context;
  for (int i = 0; i < count; ++i) {
    const std::string window = text.substr(text.size() > size_t(context) ? text.size() - context : 0);
    auto tokens = torch::empty({1, int64_t(window.size())}, torch::kLong);
    for (size_t j = 0; j < window.size(); ++j) tokens[0][j] = static_cast<uint8_t>(window[j]);
    const auto logits = model->forward(tokens.to(device)).select(1, -1).to(torch::kFloat);
    const auto next = torch::multinomial(torch::softmax(logits / 0.8, -1), 1).item<int64_t>();
    text.push_back(static_cast<char>(next));
  }
  model->train();
  return text;
}

// The training loop and the sample, with amp's two edits.
template <class Optimizer>
int train(examples::CharTransformer& model, Optimizer& optimizer, amp::Options options, c10::Device device,
          const at::Tensor& bytes) {
  const int steps = absl::GetFlag(FLAGS_steps), batch = absl::GetFlag(FLAGS_batch_size);
  const examples::TransformerConfig& config = model->config;
  const examples::NonFiniteInjection injection(absl::GetFlag(FLAGS_inject_non_finite), *model);
  options.overflow_provenance = injection.enabled();
  amp::initialize(model, optimizer, options);
  const std::string policy_file = absl::GetFlag(FLAGS_measured_policy_file);
  if (options.measured_policy && !policy_file.empty() && std::filesystem::exists(policy_file)) {
    amp::load_measured_policy(policy_file);
  }

  examples::Progress progress(50, steps);
  examples::StepCsv csv(absl::GetFlag(FLAGS_csv));
  examples::StepTrace trace(absl::GetFlag(FLAGS_trace), device);
  double last_loss = 0;
  // The step, with amp's two edits; with --cuda_graph captured once and
  // replayed (the batch and the loss then keep their addresses: each batch
  // is copied into them).
  const bool graphed = absl::GetFlag(FLAGS_cuda_graph);
  // ms/step leaves out the first step, which pays for start-up (kernels
  // loaded, cuBLAS handles and allocator caches set up), and with
  // --cuda_graph the warm-up and the capture.
  const int untimed = graphed ? examples::GraphedStep::kWarmupSteps + 1 : 1;
  auto start = std::chrono::steady_clock::now();
  at::Tensor windows, loss;
  examples::GraphedStep train_step(graphed, [&] {
    optimizer.zero_grad();
    loss = model->loss(windows.narrow(1, 0, config.context), windows.narrow(1, 1, config.context));  // --fused_loss: amp::linear_cross_entropy
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    // Every level; two fused ops, as Python's foreach clip. The step in
    // backward applied the gradients already, and clipping needs them all.
    if (!options.step_in_backward.value_or(false)) amp::clip_grad_norm(optimizer, 1.0);
    optimizer.step();
  }, [&] { amp::skipped_steps(optimizer); });
  for (int step = 0; step < steps; ++step) {
    if (step == untimed) start = std::chrono::steady_clock::now();
    const auto starts = torch::randint(0, bytes.size(0) - config.context - 1, {batch});
    const auto offsets = torch::arange(config.context + 1);
    const auto batch_windows = bytes.index({starts.unsqueeze(1) + offsets}).to(device);  // inputs, and targets one on
    if (graphed && windows.defined()) {
      windows.copy_(batch_windows);
    } else {
      windows = batch_windows;
    }

    trace.at_step(step + 1);
    const auto injected = injection.inject(step + 1, *model);
    train_step();
    if (injection.at(step + 1)) examples::print_injection_outcome(std::cout, optimizer);
    last_loss = loss.item<double>();
    progress.update(step + 1, last_loss, amp::loss_scaler()->scale(), int64_t(batch) * config.context);
    csv.add(step + 1, last_loss, amp::loss_scaler()->scale());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  progress.finish();
  std::printf("opt_level %s  final loss %.3f (%.3f bits/token)  ms/step %.1f  skipped steps %lld  peak RSS %.0f MiB  "
              "peak allocated %.1f MiB\n",
              examples::level_name(options).c_str(), last_loss, last_loss / std::log(2.0),
              1000 * seconds / std::max(steps - untimed, 1), static_cast<long long>(amp::skipped_steps(optimizer)),
              examples::peak_rss_mib(), examples::peak_allocated_mib(device));
  if (config.vocab == 256) {
    std::printf("sample: %s\n", sample(model, device, "This License", absl::GetFlag(FLAGS_sample_chars)).c_str());
  } else {
    std::printf("sample: none (byte-pair tokens folded into --vocab do not map back to text)\n");
  }
  if (options.measured_policy) {
    examples::print_measured_policy(std::cout);
    if (!absl::GetFlag(FLAGS_measured_policy_file).empty()) amp::save_measured_policy(absl::GetFlag(FLAGS_measured_policy_file));
  }
  return 0;
}

int run() {
  const c10::Device device = examples::parse_device(absl::GetFlag(FLAGS_device));
  amp::Options options = examples::amp_options(
      absl::GetFlag(FLAGS_opt_level), absl::GetFlag(FLAGS_dtype), device, absl::GetFlag(FLAGS_verbosity));
  options.measured_policy = absl::GetFlag(FLAGS_measured_policy);
  options.keep_cpu_memory = absl::GetFlag(FLAGS_keep_cpu_memory);
  examples::TransformerConfig config;
  config.context = absl::GetFlag(FLAGS_context);
  config.layers = absl::GetFlag(FLAGS_layers);
  config.width = absl::GetFlag(FLAGS_width);
  config.heads = absl::GetFlag(FLAGS_heads);
  config.vocab = absl::GetFlag(FLAGS_vocab);
  config.fused_loss = absl::GetFlag(FLAGS_fused_loss);
  config.loss_vocab_window = absl::GetFlag(FLAGS_loss_vocab_window);
  config.loss_chunk_tokens = absl::GetFlag(FLAGS_loss_chunk_tokens);
  config.fused_attention = examples::fused_attention_named(absl::GetFlag(FLAGS_attention));
  config.recompute = absl::GetFlag(FLAGS_recompute);
  config.recompute_run = absl::GetFlag(FLAGS_recompute_run);
  config.recompute_slices = absl::GetFlag(FLAGS_recompute_slices);
  config.recompute_keep_gemms = absl::GetFlag(FLAGS_recompute_keep_gemms);
  if (absl::GetFlag(FLAGS_eight_bit_state)) options.optimizer_state_dtype = torch::kUInt8;
  options.step_in_backward = absl::GetFlag(FLAGS_step_in_backward);
  if (absl::GetFlag(FLAGS_steps) < 0 || absl::GetFlag(FLAGS_batch_size) < 1 || config.context < 2 ||
      config.layers < 1 || config.heads < 1 || config.width % config.heads != 0 ||
      config.recompute_run < 0 || config.recompute_slices < 0 || config.vocab < 2) {
    throw std::invalid_argument("--steps must be >= 0, --batch_size >= 1, --context >= 2, --layers >= 1, "
                                "--heads >= 1, --width a multiple of --heads, --recompute_run and --recompute_slices >= 0, --vocab >= 2");
  }
  if (config.loss_vocab_window < 0 || config.loss_chunk_tokens < 0 ||
      (!config.fused_loss && (config.loss_vocab_window > 0 || config.loss_chunk_tokens > 0))) {
    throw std::invalid_argument("--loss_vocab_window and --loss_chunk_tokens must be >= 0, and set only with "
                                "--fused_loss (they shape amp::linear_cross_entropy's chunks)");
  }
  const bool cuda_graph = absl::GetFlag(FLAGS_cuda_graph);
  const bool fused = examples::use_fused_optimizer(absl::GetFlag(FLAGS_optimizer), options, cuda_graph);
  if (cuda_graph) examples::check_cuda_graph(device, fused, options, absl::GetFlag(FLAGS_inject_non_finite));
  const std::string corpus = examples::read_license_corpus(absl::GetFlag(FLAGS_corpus_dir));
  const at::Tensor bytes = examples::corpus_tokens(corpus, config.vocab);  // bytes, or byte pairs

  torch::manual_seed(absl::GetFlag(FLAGS_seed));
  examples::CharTransformer model(config);
  model->to(device);
  const double lr = absl::GetFlag(FLAGS_lr);
  if (fused) {
    amp::optim::FusedAdamW optimizer(model->parameters(), lr);
    return train(model, optimizer, options, device, bytes);
  }
  torch::optim::AdamW optimizer(model->parameters(), lr);
  return train(model, optimizer, options, device, bytes);
}

}  // namespace

int main(int argc, char** argv) {
  return examples::run_main(argc, argv, "Trains a character-level transformer on Debian's license texts with amp.", run);
}
