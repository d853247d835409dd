// SPDX-License-Identifier: BSD-3-Clause
// A DCGAN on Fashion-MNIST: Apex's multi-model example. Two models, two
// optimizers and three losses, each loss with its own loss scaler
// (num_losses=3, loss_id 0..2).
//
//   gan --opt_level=O1 --steps=300
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include "common/dcgan.h"
#include "common/fashion_mnist_data.h"
#include "common/gradient_check.h"
#include "common/run_setup.h"

#include <absl/flags/flag.h>
#include <torch/torch.h>

#include <iostream>

ABSL_FLAG(std::string, opt_level, "O1", "amp opt level: O0..O5 (O6 steps only amp's fused optimizers; the GAN steps LibTorch's Adam)");
ABSL_FLAG(std::string, dtype, "", "low-precision dtype: fp16 or bf16");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda");
ABSL_FLAG(int, steps, 300, "training steps (one batch of real images each)");
ABSL_FLAG(int, batch_size, 64, "batch size");
ABSL_FLAG(double, lr, 2e-4, "Adam learning rate of both models");
ABSL_FLAG(int, seed, 0, "random seed");
ABSL_FLAG(std::string, data_dir, examples::kDefaultFashionMnistDir, "directory of the idx .gz files");
ABSL_FLAG(int, verbosity, 1, "amp verbosity");
ABSL_FLAG(bool, check_gradients, false,
          "each step, compare the gradients amp hands both optimizers with float64 LibTorch at the same "
          "weights; fail when they differ by more than the low dtype explains");

namespace {

int run() {
  const c10::Device device = examples::parse_device(absl::GetFlag(FLAGS_device));
  amp::Options options = examples::amp_options(absl::GetFlag(FLAGS_opt_level), absl::GetFlag(FLAGS_dtype),
                                               device, absl::GetFlag(FLAGS_verbosity));
  options.num_losses = 3;
  const int steps = absl::GetFlag(FLAGS_steps), batch = absl::GetFlag(FLAGS_batch_size);
  if (steps < 0 || batch < 1) throw std::invalid_argument("--steps must be >= 0 and --batch_size >= 1");
  const auto data = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), true, int64_t(steps) * batch);
  const auto real_images = (data.images * 0.3530 + 0.2860) * 2 - 1;  // back to [-1, 1]

  torch::manual_seed(absl::GetFlag(FLAGS_seed));
  examples::Generator generator;
  examples::Discriminator discriminator;
  generator->to(device);
  discriminator->to(device);
  const auto adam = torch::optim::AdamOptions(absl::GetFlag(FLAGS_lr)).betas({0.5, 0.999});
  torch::optim::Adam opt_g(generator->parameters(), adam);
  torch::optim::Adam opt_d(discriminator->parameters(), adam);

  amp::initialize({generator, discriminator}, {opt_g, opt_d}, options);

  // A generator loss backpropagates through the discriminator; its gradients
  // there must never reach the discriminator's optimizer. Measured at batch
  // 16 (BatchNorm amplifies rounding): fp32 is within 1e-3 of float64, bf16
  // within 0.1; leaked gradients of another loss make it 1 or more.
  const bool check = absl::GetFlag(FLAGS_check_gradients);
  const double tolerance = options.opt_level == amp::O0 ? 1e-2 : 0.3;
  double worst_d = 0, worst_g = 0;
  auto check_error = [&](double error, double& worst, const char* which, int step) {
    worst = std::max(worst, error);
    if (error > tolerance) {
      throw std::runtime_error("gradient check failed at step " + std::to_string(step) + ": " + which +
                               "'s gradients differ from float64 by " + std::to_string(error) + " (relative)");
    }
  };

  examples::Progress progress(50, steps);
  const auto ones = torch::ones({batch}, device), zeros = torch::zeros({batch}, device);
  double loss_d = 0, loss_g = 0;
  for (int step = 0; step < steps; ++step) {
    const auto real = real_images.narrow(0, int64_t(step) * batch % real_images.size(0), batch).to(device);
    const auto noise = torch::randn({batch, examples::kLatent}, device);
    const auto fake = generator->forward(noise);

    // Discriminator: real and fake batches, two losses with their own
    // scalers; computed first, then a guard each (an overflow in either
    // skips the discriminator's step).
    opt_d.zero_grad();
    const auto err_real = torch::binary_cross_entropy_with_logits(discriminator->forward(real), ones);
    const auto err_fake = torch::binary_cross_entropy_with_logits(discriminator->forward(fake.detach()), zeros);
    {
      amp::scale_loss scaled(err_real, opt_d, {/*loss_id=*/0});
      scaled.backward();
    }
    {
      amp::scale_loss scaled(err_fake, opt_d, {/*loss_id=*/1});
      scaled.backward();
    }
    if (check) {
      auto d64 = examples::float64_copy(discriminator, opt_d);
      (torch::binary_cross_entropy_with_logits(d64->forward(real.to(torch::kDouble)), ones.to(torch::kDouble)) +
       torch::binary_cross_entropy_with_logits(d64->forward(fake.detach().to(torch::kDouble)), zeros.to(torch::kDouble)))
          .backward();
      check_error(examples::relative_gradient_error(opt_d, *d64), worst_d, "the discriminator", step);
    }
    opt_d.step();

    // Generator: fool the discriminator.
    opt_g.zero_grad();
    const auto err_g = torch::binary_cross_entropy_with_logits(discriminator->forward(fake), ones);
    {
      amp::scale_loss scaled(err_g, opt_g, {/*loss_id=*/2});
      scaled.backward();
    }
    if (check) {
      auto g64 = examples::float64_copy(generator, opt_g);
      auto d64 = examples::float64_copy(discriminator, opt_d);
      torch::binary_cross_entropy_with_logits(d64->forward(g64->forward(noise.to(torch::kDouble))), ones.to(torch::kDouble))
          .backward();
      check_error(examples::relative_gradient_error(opt_g, *g64), worst_g, "the generator", step);
    }
    opt_g.step();

    loss_d = (err_real + err_fake).item<double>();
    loss_g = err_g.item<double>();
    progress.update(step + 1, loss_d, amp::loss_scaler(2)->scale(), batch);
  }
  progress.finish();
  auto skipped = [](torch::optim::Optimizer& o) { return static_cast<long long>(amp::skipped_steps(o)); };
  std::printf("opt_level %s  loss D %.3f  loss G %.3f  loss scales %g %g %g  skipped steps D %lld G %lld  "
              "peak RSS %.0f MiB  peak allocated %.1f MiB\n",
              examples::level_name(options).c_str(), loss_d, loss_g, amp::loss_scaler(0)->scale(), amp::loss_scaler(1)->scale(),
              amp::loss_scaler(2)->scale(), skipped(opt_d), skipped(opt_g), examples::peak_rss_mib(),
              examples::peak_allocated_mib(device));
  if (check) std::printf("gradient check: %d steps, worst relative error vs float64 D %.2e G %.2e\n", steps, worst_d, worst_g);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::run_main(argc, argv, "Trains a DCGAN on Fashion-MNIST with amp: 2 models, 2 optimizers, 3 losses.", run);
}
