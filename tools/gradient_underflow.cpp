// SPDX-License-Identifier: BSD-3-Clause
// The gradient underflow figure (Micikevicius et al. 2018, Fig. 3) for the
// Fashion-MNIST CNN: a histogram of log2|g| of activation and weight
// gradients of one iteration, with fp16's limits, and the fraction of values
// that flush to zero in fp16 at scale 1 versus at amp's dynamic scale.
//
// The model is first trained for --warmup_steps at O1 in float16 (so the
// dynamic scale and the weights are those of a real run); the gradients of
// the next batch are then computed exactly in fp32 and binned. Beside them,
// amp's own telemetry of its last float16 step (telemetry.h): per
// parameter, underflow at the scale, zeros and the largest magnitude.
//
//   gradient_underflow --out_dir=out/underflow   # writes .csv and .png (gnuplot)
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include "common/diagnostics.h"
#include "common/fashion_mnist_data.h"
#include "common/fashion_mnist_net.h"
#include "common/run_setup.h"

#include <absl/flags/flag.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

ABSL_FLAG(int, warmup_steps, 30, "O1 fp16 training steps before the measured iteration");
ABSL_FLAG(int, batch_size, 128, "batch size");
ABSL_FLAG(std::string, data_dir, examples::kDefaultFashionMnistDir, "Fashion-MNIST directory");
ABSL_FLAG(std::string, out_dir, "out/underflow", "where the CSV files and the PNG go");

namespace {

constexpr int kMinBin = -64, kMaxBin = 20;  // log2 buckets [k, k+1)
constexpr double kFp16SmallestSubnormal = 5.960464477539063e-08;  // 2**-24
constexpr double kFp16Max = 65504.0;

struct Histogram {
  std::vector<int64_t> bins = std::vector<int64_t>(kMaxBin - kMinBin + 1, 0);
  int64_t zeros = 0, total = 0;
};

struct Summary {
  Histogram histogram;
  std::vector<double> magnitudes;  // nonzero |g|
  void add(const at::Tensor& grad) {
    const auto g = grad.detach().to(at::kDouble).abs().flatten().contiguous();
    const double* p = g.data_ptr<double>();
    for (int64_t i = 0; i < g.numel(); ++i) {
      ++histogram.total;
      if (p[i] == 0) {
        ++histogram.zeros;
        continue;
      }
      magnitudes.push_back(p[i]);
      const int bin = std::clamp(static_cast<int>(std::floor(std::log2(p[i]))), kMinBin, kMaxBin);
      ++histogram.bins[bin - kMinBin];
    }
  }
  double fraction_below(double threshold) const {
    int64_t n = 0;
    for (double m : magnitudes) n += m < threshold;
    return histogram.total ? double(n) / histogram.total : 0.0;
  }
  double fraction_above(double threshold) const {
    int64_t n = 0;
    for (double m : magnitudes) n += m > threshold;
    return histogram.total ? double(n) / histogram.total : 0.0;
  }
};

int run() {
  const int batch = absl::GetFlag(FLAGS_batch_size), warmup = absl::GetFlag(FLAGS_warmup_steps);
  const std::filesystem::path out = absl::GetFlag(FLAGS_out_dir);
  std::filesystem::create_directories(out);
  const auto data = examples::load_fashion_mnist(absl::GetFlag(FLAGS_data_dir), true,
                                                 int64_t(warmup + 1) * batch);
  torch::manual_seed(0);
  examples::FashionNet model;
  std::shared_ptr<torch::optim::Optimizer> optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-3);
  amp::Options options = amp::O1;
  options.verbosity = 0;
  options.cpu_dtype = at::kHalf;
  options.precision_telemetry = true;
  std::tie(model, optimizer) = amp::initialize(model, optimizer, options);
  for (int step = 0; step < warmup; ++step) {
    optimizer->zero_grad();
    const auto loss = torch::cross_entropy_loss(model->forward(data.images.narrow(0, int64_t(step) * batch, batch)),
                                                data.labels.narrow(0, int64_t(step) * batch, batch));
    {
      amp::scale_loss scaled(loss, optimizer);
      scaled.backward();
    }
    optimizer->step();
  }
  const double scale = amp::loss_scaler()->scale();
  const std::optional<amp::PrecisionTelemetry> telemetry = amp::precision_telemetry(optimizer);

  // The measured iteration, exactly in fp32, keeping activation gradients.
  amp::disable_casts exact;
  optimizer->zero_grad();
  const auto x = data.images.narrow(0, int64_t(warmup) * batch, batch);
  std::vector<at::Tensor> activations;
  auto keep = [&](at::Tensor t) {
    t.retain_grad();
    activations.push_back(t);
    return t;
  };
  auto h = keep(model->conv1(x));
  h = keep(model->bn1(h));
  h = keep(torch::max_pool2d(torch::relu(h), 2));
  h = keep(model->conv2(h));
  h = keep(model->bn2(h));
  h = keep(torch::max_pool2d(torch::relu(h), 2).flatten(1));
  h = keep(model->fc1(h));
  h = keep(model->fc2(torch::relu(h)));
  torch::cross_entropy_loss(h, data.labels.narrow(0, int64_t(warmup) * batch, batch)).backward();

  Summary acts, weights;
  for (const auto& a : activations) acts.add(a.grad());
  for (const auto& p : model->parameters()) weights.add(p.grad());

  std::ofstream csv(out / "gradient_histogram.csv");
  csv << "log2_abs_grad,activation_gradients,weight_gradients\n";
  for (int b = kMinBin; b <= kMaxBin; ++b) {
    csv << b << "," << acts.histogram.bins[b - kMinBin] << "," << weights.histogram.bins[b - kMinBin] << "\n";
  }
  std::ofstream summary_csv(out / "underflow_summary.csv");
  summary_csv << "gradients,values,exact_zeros,flush_to_zero_at_scale_1,flush_to_zero_at_dynamic_scale,overflow_at_dynamic_scale,dynamic_scale\n";
  std::printf("Gradients of one Fashion-MNIST CNN iteration (batch %d) after %d O1 fp16 steps; dynamic scale %g\n\n",
              batch, warmup, scale);
  std::printf("| gradients | values | exact zeros | flush to zero in fp16 at scale 1 | at scale %g | overflow at scale %g |\n",
              scale, scale);
  std::printf("|---|---:|---:|---:|---:|---:|\n");
  for (const auto& [name, s] : {std::pair<const char*, const Summary*>{"activation", &acts}, {"weight", &weights}}) {
    const double at_one = s->fraction_below(kFp16SmallestSubnormal);
    const double at_scale = s->fraction_below(kFp16SmallestSubnormal / scale);
    const double overflow = s->fraction_above(kFp16Max / scale);
    std::printf("| %s | %lld | %.2f%% | %.2f%% | %.2f%% | %.4f%% |\n", name,
                static_cast<long long>(s->histogram.total), 100.0 * s->histogram.zeros / s->histogram.total,
                100 * at_one, 100 * at_scale, 100 * overflow);
    summary_csv << name << "," << s->histogram.total << "," << s->histogram.zeros << "," << at_one << ","
                << at_scale << "," << overflow << "," << scale << "\n";
  }

  if (telemetry) {
    std::printf("\namp's telemetry of its last O1 float16 step (the weights' gradients as amp unscaled them):\n\n");
    std::ostringstream table;
    examples::print_telemetry(table, *telemetry);
    std::printf("%s", table.str().c_str());
  }

  csv.close();
  summary_csv.close();
  const std::filesystem::path script = out / "gradient_histogram.gnuplot";
  std::ofstream(script) << "set terminal png size 1000,560\nset output '" << (out / "gradient_histogram.png").string()
                        << "'\nset datafile separator ','\nset key top right\nset logscale y\n"
                        << "set xlabel 'log2 |gradient|'\nset ylabel 'values'\n"
                        << "set title 'Fashion-MNIST CNN gradients of one iteration (fp32); fp16 limits; amp scale " << scale << "'\n"
                        << "set arrow from -24, graph 0 to -24, graph 1 nohead dt 2 lc rgb 'red'\n"
                        << "set label 'fp16 smallest subnormal 2^-24' at -24.6, graph 0.03 rotate by 90 tc rgb 'red'\n"
                        << "set arrow from -14, graph 0 to -14, graph 1 nohead dt 3 lc rgb 'orange'\n"
                        << "set label 'fp16 smallest normal 2^-14' at -14.6, graph 0.03 rotate by 90 tc rgb 'orange'\n"
                        << "set arrow from 15.999, graph 0 to 15.999, graph 1 nohead dt 2 lc rgb 'red'\n"
                        << "set label 'fp16 max 65504' at 15.4, graph 0.03 rotate by 90 tc rgb 'red'\n"
                        << "set arrow from " << -24 - std::log2(scale) << ", graph 0 to " << -24 - std::log2(scale)
                        << ", graph 1 nohead lc rgb 'dark-green'\n"
                        << "set label 'flush threshold at amp scale' at " << -24.6 - std::log2(scale)
                        << ", graph 0.03 rotate by 90 tc rgb 'dark-green'\n"
                        << "plot '" << (out / "gradient_histogram.csv").string()
                        << "' using 1:($2>0?$2:1/0) skip 1 with steps lw 2 title 'activation gradients', '' using 1:($3>0?$3:1/0) skip 1 with steps lw 2 title 'weight gradients'\n";
  const int rc = std::system(("gnuplot " + script.string()).c_str());
  std::printf("\nWrote %s/gradient_histogram.csv, underflow_summary.csv%s\n", out.c_str(),
              rc == 0 ? ", gradient_histogram.png" : " (gnuplot not found: no PNG)");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return examples::run_main(argc, argv, "Histogram of gradient magnitudes against fp16's range, at scale 1 and amp's scale.", run);
}
