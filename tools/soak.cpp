// SPDX-License-Identifier: BSD-3-Clause
// Soak: the transformer example's model trained for many steps at one opt
// level with random faults - inf gradients, NaN losses, exceptions inside the
// guard before and after unscale() - while memory is sampled. Resident
// memory, the heap in use and amp's cast cache must stay flat after warm-up.
//
//   soak --steps=2000 --opt_level=O2
//
// Prints a table every --every steps and, at the end, the growth from the
// first sample after --warmup steps to the last; exits 1 when the heap grew
// by more than --max_growth_mib or the cast cache is not empty between steps.
#include "common/char_transformer.h"

#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include <absl/flags/flag.h>
#include <absl/flags/parse.h>

#include <torch/torch.h>

#include <malloc.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <random>

ABSL_FLAG(int, steps, 2000, "training steps");
ABSL_FLAG(std::string, opt_level, "O2", "amp opt level");
ABSL_FLAG(int, batch_size, 8, "sequences per batch");
ABSL_FLAG(int, context, 32, "characters per sequence");
ABSL_FLAG(int, every, 100, "steps between memory samples");
ABSL_FLAG(int, warmup, 200, "steps before the memory baseline");
ABSL_FLAG(double, max_growth_mib, 8, "largest heap growth after warm-up that passes");
ABSL_FLAG(uint64_t, seed, 1, "fault and data seed");
ABSL_FLAG(int64_t, growth_interval, 5, "clean steps before the loss scale grows (faults are frequent here)");

namespace {

double rss_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1048576.0);
}

double heap_mib() { return mallinfo2().uordblks / 1048576.0; }

struct InjectedError : std::runtime_error {
  InjectedError() : std::runtime_error("injected") {}
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int steps = absl::GetFlag(FLAGS_steps), batch = absl::GetFlag(FLAGS_batch_size);
  examples::TransformerConfig config;
  config.context = absl::GetFlag(FLAGS_context);
  const std::string corpus = examples::read_license_corpus();
  auto bytes = torch::empty({int64_t(corpus.size())}, torch::kLong);
  for (size_t i = 0; i < corpus.size(); ++i) bytes[i] = static_cast<uint8_t>(corpus[i]);

  torch::manual_seed(absl::GetFlag(FLAGS_seed));
  examples::CharTransformer model(config);
  std::shared_ptr<torch::optim::Optimizer> optimizer = std::make_shared<torch::optim::AdamW>(model->parameters(), 3e-3);
  amp::Options options = absl::GetFlag(FLAGS_opt_level);
  options.verbosity = 0;
  options.dynamic_scaling.growth_interval = absl::GetFlag(FLAGS_growth_interval);
  std::tie(model, optimizer) = amp::initialize(model, optimizer, options);

  std::mt19937_64 random(absl::GetFlag(FLAGS_seed));
  std::uniform_real_distribution<double> coin(0, 1);
  int64_t faults = 0, exceptions = 0, nonempty_cache = 0;
  double base_rss = 0, base_heap = 0, last_loss = 0;
  std::printf("%6s %9s %9s %11s %9s %8s %8s\n", "step", "RSS MiB", "heap MiB", "cast cache", "scale", "skipped", "loss");
  for (int step = 1; step <= steps; ++step) {
    const auto starts = torch::randint(0, bytes.size(0) - config.context - 1, {batch});
    const auto windows = bytes.index({starts.unsqueeze(1) + torch::arange(config.context + 1)});
    const auto inputs = windows.narrow(1, 0, config.context), targets = windows.narrow(1, 1, config.context);
    if (step == absl::GetFlag(FLAGS_warmup)) base_rss = rss_mib(), base_heap = heap_mib();
    const double r = coin(random);
    optimizer->zero_grad();
    auto loss = torch::cross_entropy_loss(model->forward(inputs).reshape({-1, config.vocab}), targets.reshape({-1}));
    if (r < 0.04) loss = loss * std::numeric_limits<float>::quiet_NaN(), ++faults;
    try {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
      if (r >= 0.04 && r < 0.12) {
        model->head->weight.grad().view(-1)[step % 100].fill_(std::numeric_limits<float>::infinity());
        ++faults;
      }
      if (r >= 0.12 && r < 0.15) throw InjectedError();
      if (r >= 0.15 && r < 0.18) {
        scaled.unscale();
        throw InjectedError();
      }
      scaled.finish();
    } catch (const InjectedError&) {
      ++exceptions;
      continue;  // the loop skips this batch
    }
    optimizer->step();
    last_loss = loss.item<double>();
    nonempty_cache += amp::cast_cache_size() != 0;
    if (step % absl::GetFlag(FLAGS_every) == 0) {
      std::printf("%6d %9.1f %9.1f %11zu %9.3g %8lld %8.3f\n", step, rss_mib(), heap_mib(), amp::cast_cache_size(),
                  amp::loss_scaler()->scale(), static_cast<long long>(amp::skipped_steps(*optimizer)), last_loss);
    }
  }
  const double rss_growth = rss_mib() - base_rss, heap_growth = heap_mib() - base_heap;
  std::printf("soak %s: %d steps, %lld faults, %lld exceptions in guards, %lld skipped steps; after step %d: RSS %+.1f MiB, "
              "heap %+.1f MiB; steps ending with a non-empty cast cache: %lld\n",
              amp::to_string(options.opt_level), steps, static_cast<long long>(faults), static_cast<long long>(exceptions),
              static_cast<long long>(amp::skipped_steps(*optimizer)), absl::GetFlag(FLAGS_warmup), rss_growth,
              heap_growth, static_cast<long long>(nonempty_cache));
  return heap_growth <= absl::GetFlag(FLAGS_max_growth_mib) && nonempty_cache == 0 ? 0 : 1;
}
