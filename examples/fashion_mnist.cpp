// SPDX-License-Identifier: BSD-3-Clause
// Trains a small CNN on Fashion-MNIST with amp.
//
//   fashion_mnist --opt_level=O2 --epochs=2
//
// The model and loop are plain LibTorch, written as LibTorch's own examples
// write them (the optimizer held by value); amp adds two things: the
// amp::initialize call and the amp::scale_loss guard around backward.
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>
#include <amp/measured_policy.h>

#include "common/fashion_mnist_data.h"
#include "common/fashion_mnist_net.h"
#include "common/graphed_step.h"
#include "common/diagnostics.h"
#include "common/step_csv.h"
#include "common/step_trace.h"
#include "common/run_setup.h"

#include <absl/flags/flag.h>
#include <torch/torch.h>

#include <sys/resource.h>

#include <chrono>
#include <filesystem>
#include <iostream>

ABSL_FLAG(std::string, opt_level, "O1",
          "amp opt level: O0, O1, O2, O3, O4 (O1 bf16), O5 (O2 bf16), O6 (bf16 without float32 masters), "
          "O5+fp8 (O5 with linear layers in float8)");
ABSL_FLAG(std::string, dtype, "", "low-precision dtype: fp16 or bf16 (default: bf16 on CPU, fp16 on CUDA)");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda");
ABSL_FLAG(int, epochs, 1, "training epochs");
ABSL_FLAG(int, batch_size, 128, "batch size");
ABSL_FLAG(double, lr, 2e-3, "Adam learning rate");
ABSL_FLAG(std::string, optimizer, "",
          "libtorch (torch::optim::Adam) or fused (amp::optim::FusedAdam); default: fused at O6, whose "
          "stochastic rounding needs it, libtorch otherwise");
ABSL_FLAG(bool, eight_bit_state, false, "keep Adam's moments in 8 bits (optimizer_state_dtype uint8; fused optimizer)");
ABSL_FLAG(int, seed, 0, "random seed (weights and batch order)");
ABSL_FLAG(std::string, data_dir, examples::kDefaultFashionMnistDir, "directory of the idx .gz files");
ABSL_FLAG(int64_t, train_limit, 20000,
          "use only the first N training images (0: all 60000); the default keeps the first run to "
          "about a minute on a 2-core CPU without bf16 arithmetic");
ABSL_FLAG(int64_t, test_limit, 0, "use only the first N test images (0: all 10000)");
ABSL_FLAG(std::string, checkpoint, "", "write a checkpoint (model, optimizer, amp) here after training");
ABSL_FLAG(std::string, resume, "", "resume from this checkpoint before training");
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
ABSL_FLAG(int, verbosity, 1, "amp verbosity: 0 silent, 1 properties and skipped steps");
ABSL_FLAG(bool, cuda_graph, false,
          "capture the whole training step in a CUDA graph after 3 warm-up steps and replay it (--device=cuda, "
          "amp's fused optimizer; each epoch's last partial batch is left out: a graph's shapes are fixed)");
ABSL_FLAG(std::string, inject_non_finite, "",
          "'<module>:<step>' (e.g. 'fc1:100'): make that module's first weight inf for that step, and print "
          "what amp's overflow provenance says of it");

namespace {

using Net = examples::FashionNet;

double accuracy(Net& model, const examples::ImageDataset& test, c10::Device device, int batch_size) {
  torch::NoGradGuard no_grad;
  model->eval();
  int64_t correct = 0;
  for (int64_t start = 0; start < test.images.size(0); start += batch_size) {
    const int64_t n = std::min<int64_t>(batch_size, test.images.size(0) - start);
    const auto logits = model->forward(test.images.narrow(0, start, n).to(device));
    correct += logits.argmax(1).eq(test.labels.narrow(0, start, n).to(device)).sum().item<int64_t>();
  }
  model->train();
  return 100.0 * correct / test.images.size(0);
}


// The training loop, as LibTorch's examples write it, with amp's two edits.
template <class Optimizer>
int train(Net& model, Optimizer& optimizer, amp::Options options, c10::Device device,
          const examples::ImageDataset& train_set, const examples::ImageDataset& test) {
  const int batch_size = absl::GetFlag(FLAGS_batch_size);
  const int epochs = absl::GetFlag(FLAGS_epochs);
  const examples::NonFiniteInjection injection(absl::GetFlag(FLAGS_inject_non_finite), *model);
  options.overflow_provenance = injection.enabled();

  amp::initialize(model, optimizer, options);
  const std::string policy_file = absl::GetFlag(FLAGS_measured_policy_file);
  if (options.measured_policy && !policy_file.empty() && std::filesystem::exists(policy_file)) {
    amp::load_measured_policy(policy_file);
  }

  if (!absl::GetFlag(FLAGS_resume).empty()) {
    amp::load_checkpoint(absl::GetFlag(FLAGS_resume), {model}, {optimizer});
    std::cout << "resumed from " << absl::GetFlag(FLAGS_resume) << "\n";
  }
  examples::StepCsv csv(absl::GetFlag(FLAGS_csv));

  // The step, as LibTorch's examples write it with amp's two edits; with
  // --cuda_graph captured once and replayed (images, labels and loss then
  // keep their addresses: each batch is copied into them).
  const bool graphed = absl::GetFlag(FLAGS_cuda_graph);
  at::Tensor images, labels, loss;
  examples::GraphedStep train_step(graphed, [&] {
    optimizer.zero_grad();
    loss = torch::cross_entropy_loss(model->forward(images), labels);
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  }, [&] { amp::skipped_steps(optimizer); });

  const int64_t n = train_set.images.size(0);
  if (graphed && n < batch_size) {
    throw std::invalid_argument("--cuda_graph leaves out partial batches: --train_limit must be >= --batch_size");
  }
  const int64_t batches = graphed ? n / batch_size : (n + batch_size - 1) / batch_size;
  int64_t step = 0;
  double seconds = 0;
  examples::Progress progress(50, epochs * batches);
  examples::StepTrace trace(absl::GetFlag(FLAGS_trace), device);
  for (int epoch = 0; epoch < epochs; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    const auto order = torch::randperm(n);
    for (int64_t first = 0; first < n; first += batch_size) {
      if (graphed && n - first < batch_size) break;  // a graph's shapes are fixed
      const auto index = order.narrow(0, first, std::min<int64_t>(batch_size, n - first));
      const auto batch_images = train_set.images.index_select(0, index).to(device);
      const auto batch_labels = train_set.labels.index_select(0, index).to(device);
      if (graphed && images.defined()) {
        images.copy_(batch_images), labels.copy_(batch_labels);
      } else {
        images = batch_images, labels = batch_labels;
      }

      trace.at_step(step + 1);
      const auto injected = injection.inject(step + 1, *model);
      train_step();

      ++step;
      if (injection.at(step)) examples::print_injection_outcome(std::cout, optimizer);
      const double loss_value = loss.item<double>();
      const double scale = amp::loss_scaler()->scale();
      progress.update(step, loss_value, scale, index.size(0));
      csv.add(step, loss_value, scale);
    }
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  progress.finish();
  if (!absl::GetFlag(FLAGS_checkpoint).empty()) {
    amp::save_checkpoint(absl::GetFlag(FLAGS_checkpoint), {model}, {optimizer});
  }
  std::printf("opt_level %s  test accuracy %.2f%%  time/epoch %.1f s  ms/step %.1f  skipped steps %lld  "
              "peak RSS %.0f MiB  peak allocated %.1f MiB\n",
              examples::level_name(options).c_str(), accuracy(model, test, device, 512),
              epochs > 0 ? seconds / epochs : 0.0, step > 0 ? 1000 * seconds / step : 0.0,
              static_cast<long long>(amp::skipped_steps(optimizer)), examples::peak_rss_mib(),
              examples::peak_allocated_mib(device));
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
  if (absl::GetFlag(FLAGS_eight_bit_state)) options.optimizer_state_dtype = torch::kUInt8;
  if (absl::GetFlag(FLAGS_batch_size) < 1) throw std::invalid_argument("--batch_size must be >= 1");
  if (absl::GetFlag(FLAGS_epochs) < 0) throw std::invalid_argument("--epochs must be >= 0");
  const bool cuda_graph = absl::GetFlag(FLAGS_cuda_graph);
  const bool fused = examples::use_fused_optimizer(absl::GetFlag(FLAGS_optimizer), options, cuda_graph);
  if (cuda_graph) examples::check_cuda_graph(device, fused, options, absl::GetFlag(FLAGS_inject_non_finite));

  const auto train_set = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), true,
                                                      absl::GetFlag(FLAGS_train_limit));
  const auto test = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), false,
                                                 absl::GetFlag(FLAGS_test_limit));
  torch::manual_seed(absl::GetFlag(FLAGS_seed));
  Net model;
  model->to(device);
  const double lr = absl::GetFlag(FLAGS_lr);
  if (fused) {
    amp::optim::FusedAdam optimizer(model->parameters(), lr);
    return train(model, optimizer, options, device, train_set, test);
  }
  torch::optim::Adam optimizer(model->parameters(), lr);
  return train(model, optimizer, options, device, train_set, test);
}

}  // namespace

int main(int argc, char** argv) {
  return examples::run_main(argc, argv, "Trains a CNN on Fashion-MNIST with amp mixed precision.", run);
}
