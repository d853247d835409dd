// Precision report: runs one training iteration of an example model under
// amp and prints every intercepted op - operator, input dtypes, output dtype,
// policy applied, calls, casts, cache hits, bytes cast - and amp's gradient
// telemetry per layer (telemetry.h): underflow at the loss scale, zeros and
// the largest magnitude. Read it to answer "why is this op in fp16?" and
// "what does the low dtype lose of this layer's gradient?".
//
//   precision_report --model=transformer --opt_level=O1
#include <amp/amp.h>

#include "common/char_transformer.h"
#include "common/dcgan.h"
#include "common/diagnostics.h"
#include "common/fashion_mnist_net.h"
#include "common/run_setup.h"

#include <absl/flags/flag.h>
#include <torch/torch.h>

#include <iostream>
#include <optional>

ABSL_FLAG(std::string, model, "cnn", "cnn (Fashion-MNIST CNN), gan (DCGAN) or transformer (character LM)");
ABSL_FLAG(std::string, opt_level, "O1", "amp opt level");
ABSL_FLAG(std::string, dtype, "", "fp16 or bf16");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda");
ABSL_FLAG(int, batch_size, 16, "batch size of the iteration");

namespace {

// One iteration: forward, loss, scale_loss backward, step. Returns the loss.
template <class Forward>
void iterate(amp::OptimizerPtr& optimizer, Forward&& loss_of_forward) {
  optimizer->zero_grad();
  const at::Tensor loss = loss_of_forward();
  {
    amp::scale_loss scaled(loss, optimizer);
    scaled.backward();
  }
  optimizer->step();
}

int run() {
  const c10::Device device = examples::parse_device(absl::GetFlag(FLAGS_device));
  amp::Options options = examples::amp_options(absl::GetFlag(FLAGS_opt_level), absl::GetFlag(FLAGS_dtype),
                                               device, /*verbosity=*/0);
  options.precision_telemetry = true;
  const std::string name = absl::GetFlag(FLAGS_model);
  const int64_t batch = absl::GetFlag(FLAGS_batch_size);
  torch::manual_seed(0);
  amp::Handle handle;
  std::unique_ptr<amp::OpStatsRecorder> recorder;
  std::optional<amp::PrecisionTelemetry> telemetry;
  if (name == "cnn") {
    examples::FashionNet model;
    model->to(device);
    amp::OptimizerPtr optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-3);
    std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
    recorder = std::make_unique<amp::OpStatsRecorder>();
    iterate(optimizer, [&] {
      return torch::cross_entropy_loss(model->forward(torch::randn({batch, 1, 28, 28}, device)),
                                       torch::randint(0, 10, {batch}, torch::TensorOptions(device).dtype(torch::kLong)));
    });
    telemetry = amp::precision_telemetry(optimizer);
  } else if (name == "gan") {
    examples::Generator generator;
    examples::Discriminator discriminator;
    generator->to(device);
    discriminator->to(device);
    amp::OptimizerPtr optimizer = std::make_shared<torch::optim::Adam>(generator->parameters(), 1e-3);
    handle.initialize({generator, discriminator}, {optimizer}, options);
    recorder = std::make_unique<amp::OpStatsRecorder>();
    iterate(optimizer, [&] {
      const auto fake = generator->forward(torch::randn({batch, examples::kLatent}, device));
      return torch::binary_cross_entropy_with_logits(discriminator->forward(fake), torch::ones({batch}, device));
    });
    telemetry = amp::precision_telemetry(optimizer);
  } else if (name == "transformer") {
    examples::CharTransformer model;
    model->to(device);
    amp::OptimizerPtr optimizer = std::make_shared<torch::optim::AdamW>(model->parameters(), 1e-3);
    std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
    recorder = std::make_unique<amp::OpStatsRecorder>();
    iterate(optimizer, [&] {
      const auto tokens = torch::randint(0, 256, {batch, 65}, torch::TensorOptions(device).dtype(torch::kLong));
      const auto logits = model->forward(tokens.narrow(1, 0, 64));
      return torch::cross_entropy_loss(logits.reshape({-1, 256}), tokens.narrow(1, 1, 64).reshape({-1}));
    });
    telemetry = amp::precision_telemetry(optimizer);
  } else {
    throw std::invalid_argument("--model must be cnn, gan or transformer, got '" + name + "'");
  }
  std::cout << "Precision report: one training iteration of the " << name << " model at "
            << amp::to_string(options.opt_level) << " on " << device << " (batch " << batch << ")\n\n"
            << amp::format_op_stats(recorder->stats());
  const amp::CastCounts counts = amp::cast_counts();
  std::cout << "\nProcess totals: " << counts.casts << " casts, " << counts.cache_hits << " cache hits\n\n";
  if (telemetry) examples::print_telemetry(std::cout, *telemetry);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::run_main(argc, argv, "Prints amp's per-op precision table for one training iteration of an example model.", run);
}
