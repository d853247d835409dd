// SPDX-License-Identifier: BSD-3-Clause
// Precision report: runs one training iteration of an example model under
// amp and prints every intercepted op - operator, input dtypes, output dtype,
// policy applied, calls, casts, cache hits, bytes cast - and amp's gradient
// telemetry per layer (telemetry.h): underflow at the loss scale, zeros and
// the largest magnitude, and with the fp8 property each float8 operand's
// saturated and flushed fractions; then memory: bytes per parameter of weights,
// masters, gradients and optimizer state, and the allocator's bytes over an
// iteration. Read it to answer "why is this op in fp16?", "what does the low
// dtype lose of this layer's gradient?" and "where do my bytes go?".
//
//   precision_report --model=transformer --opt_level=O1
#include <amp/alignment.h>
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include "common/char_transformer.h"
#include "common/dcgan.h"
#include "common/diagnostics.h"
#include "common/fashion_mnist_net.h"
#include "common/run_setup.h"

#include <absl/flags/flag.h>
#include <torch/torch.h>

#include <functional>
#include <iostream>
#include <optional>

ABSL_FLAG(std::string, model, "cnn", "cnn (Fashion-MNIST CNN), gan (DCGAN) or transformer (character LM)");
ABSL_FLAG(std::string, opt_level, "O1", "amp opt level");
ABSL_FLAG(std::string, dtype, "", "fp16 or bf16");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda");
ABSL_FLAG(int, batch_size, 16, "batch size of the iteration");

namespace {

// One iteration: forward, loss, scale_loss backward, step.
void iterate(std::shared_ptr<torch::optim::Optimizer>& optimizer, const std::function<at::Tensor()>& loss_of_forward) {
  optimizer->zero_grad();
  const at::Tensor loss = loss_of_forward();
  {
    amp::scale_loss scaled(loss, optimizer);
    scaled.backward();
  }
  optimizer->step();
}

// Bytes per parameter of what training holds (amp::training_bytes), and
// the allocator's bytes over one more iteration: held before it, and the
// most above that at once (activations and gradients).
void print_memory(std::ostream& out, std::shared_ptr<torch::optim::Optimizer>& optimizer, const std::function<at::Tensor()>& loss_of_forward,
                  c10::Device device) {
  iterate(optimizer, loss_of_forward);  // the optimizer's state exists from the first step on
  optimizer->zero_grad();
  amp::reset_peak_allocated(device);
  const int64_t held = amp::allocated_bytes(device).current;
  iterate(optimizer, loss_of_forward);
  const int64_t peak = amp::allocated_bytes(device).peak;
  const amp::TrainingBytes b = amp::training_bytes(*optimizer);
  const double n = static_cast<double>(std::max<int64_t>(b.parameters, 1));
  char line[160];
  out << "\nMemory: bytes per parameter (" << b.parameters << " parameters), measured from the tensors\n";
  for (const auto& [what, bytes] : std::vector<std::pair<const char*, int64_t>>{
           {"low-precision weight copies", b.weights}, {"what the optimizer steps", b.masters},
           {"gradients", b.gradients}, {"optimizer state", b.optimizer_state},
           {"total", b.weights + b.masters + b.gradients + b.optimizer_state}}) {
    std::snprintf(line, sizeof line, "  %-26s %6.2f\n", what, bytes / n);
    out << line;
  }
  std::snprintf(line, sizeof line, "Allocator, one more iteration: %.2f MiB held before it, %.2f MiB more at its peak "
                "(activations and gradients)\n", held / 1048576.0, (peak - held) / 1048576.0);
  out << line;
}

int run() {
  const c10::Device device = examples::parse_device(absl::GetFlag(FLAGS_device));
  amp::Options options = examples::amp_options(absl::GetFlag(FLAGS_opt_level), absl::GetFlag(FLAGS_dtype),
                                               device, /*verbosity=*/0);
  options.precision_telemetry = true;
  const std::string name = absl::GetFlag(FLAGS_model);
  const int64_t batch = absl::GetFlag(FLAGS_batch_size);
  const auto longs = torch::TensorOptions(device).dtype(torch::kLong);
  torch::manual_seed(0);
  amp::Handle handle;
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  std::function<at::Tensor()> loss_of_forward;
  std::vector<std::shared_ptr<torch::nn::Module>> models;  // for the shapes check
  // LibTorch's own optimizers, but at O6, which needs amp's fused ones.
  const bool fused = examples::use_fused_optimizer("", options);
  if (name == "cnn") {
    examples::FashionNet model;
    model->to(device);
    optimizer = fused ? std::shared_ptr<torch::optim::Optimizer>(std::make_shared<amp::optim::FusedAdam>(model->parameters(), 1e-3))
                      : std::make_shared<torch::optim::Adam>(model->parameters(), 1e-3);
    std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
    models.push_back(model.ptr());
    loss_of_forward = [=]() mutable {
      return torch::cross_entropy_loss(model->forward(torch::randn({batch, 1, 28, 28}, device)),
                                       torch::randint(0, 10, {batch}, longs));
    };
  } else if (name == "gan") {
    examples::Generator generator;
    examples::Discriminator discriminator;
    generator->to(device);
    discriminator->to(device);
    optimizer = fused ? std::shared_ptr<torch::optim::Optimizer>(std::make_shared<amp::optim::FusedAdam>(generator->parameters(), 1e-3))
                      : std::make_shared<torch::optim::Adam>(generator->parameters(), 1e-3);
    handle.initialize({generator, discriminator}, {optimizer}, options);
    models = {generator.ptr(), discriminator.ptr()};
    loss_of_forward = [=]() mutable {
      const auto fake = generator->forward(torch::randn({batch, examples::kLatent}, device));
      return torch::binary_cross_entropy_with_logits(discriminator->forward(fake), torch::ones({batch}, device));
    };
  } else if (name == "transformer") {
    examples::CharTransformer model;
    model->to(device);
    optimizer = fused ? std::shared_ptr<torch::optim::Optimizer>(std::make_shared<amp::optim::FusedAdamW>(model->parameters(), 1e-3))
                      : std::make_shared<torch::optim::AdamW>(model->parameters(), 1e-3);
    std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
    models.push_back(model.ptr());
    loss_of_forward = [=]() mutable {
      const auto tokens = torch::randint(0, 256, {batch, 65}, longs);
      const auto logits = model->forward(tokens.narrow(1, 0, 64));
      return torch::cross_entropy_loss(logits.reshape({-1, 256}), tokens.narrow(1, 1, 64).reshape({-1}));
    };
  } else {
    throw std::invalid_argument("--model must be cnn, gan or transformer, got '" + name + "'");
  }
  std::optional<amp::PrecisionTelemetry> telemetry;
  {
    amp::OpStatsRecorder recorder;
    iterate(optimizer, loss_of_forward);
    telemetry = amp::precision_telemetry(optimizer);
    std::cout << "Precision report: one training iteration of the " << name << " model at "
              << examples::level_name(options) << " on " << device << " (batch " << batch << ")\n\n"
              << amp::format_op_stats(recorder.stats());
  }
  const amp::CastCounts counts = amp::cast_counts();
  std::cout << "\nProcess totals: " << counts.casts << " casts, " << counts.cache_hits << " cache hits\n\n";
  if (telemetry) examples::print_telemetry(std::cout, *telemetry);
  if (amp::properties().fp8) {
    std::cout << "\nfloat8 quantization on " << device << ": " << amp::fp8_quantization_path(device) << "\n";
    examples::print_fp8_choices(std::cout << "\n", amp::fp8_choices());
    examples::print_fp8_telemetry(std::cout << "\n", amp::fp8_telemetry());
  }
  print_memory(std::cout, optimizer, loss_of_forward, device);
  // Shapes that fit the hardware: the layers to pad for the low dtype here.
  const c10::ScalarType low = amp::properties().low_precision_dtype(device.type());
  const int64_t multiple = amp::preferred_multiple(low, device);
  std::cout << "\nLayers whose GEMM dimensions miss " << device << "'s preferred multiple for " << low << "\n";
  for (const auto& model : models) {
    std::cout << amp::format_misaligned_layers(amp::misaligned_layers(*model, low, device), multiple);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::run_main(argc, argv, "Prints amp's per-op precision table for one training iteration of an example model.", run);
}
