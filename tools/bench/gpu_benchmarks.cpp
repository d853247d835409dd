// SPDX-License-Identifier: BSD-3-Clause
// amp's GPU benchmark: training-step time and peak memory, measured side by
// side in one run, of
//   resnet      ResNet-18, batch 256, 3x224x224
//   gpt         a GPT-2-small-shaped transformer (12 x 768, 12 heads,
//               sequence 1024, batch 8), vocabulary 50304 (GPT-2's padded to
//               a multiple of 64, as nanoGPT does), and 50257 beside it
//   small_batch the same at sequence 128, batch 1: a step launches bound
//   te_layers   four of Transformer Engine's quickstart layer (hidden 4096,
//               FFN 16384, 32 heads, sequence 2048, batch 4): where float8
//               can pay
//   loss        gpt's output layer and loss alone (8192 tokens x 768 x
//               50304): amp::linear_cross_entropy beside ATen's linear +
//               cross_entropy and the Python peers (loss_layer_peer.py:
//               torch.autocast, torch.compile, torchtune's chunked upcast,
//               Liger Kernel's fused linear cross-entropy), peak and time
// each at FP32 (TF32 off, and on) | native LibTorch autocast + hand-written
// GradScaler loop | amp O1 | O2 | O2, O5, O6 and O6 with 8-bit optimizer
// state, each block recomputed (amp::recompute) | O3 (dynamic scale; AdamW eps 1e-4 in float16, where
// 1e-8 is 0) | O4 | O5 | O5+fp8 (float8 where Fp8Scaling's rule says it
// pays) | O5+fp8 with every GEMM in float8 | amp O1 and O2 with LibTorch's
// own AdamW step | each amp level's whole step captured in a CUDA graph and
// replayed (O1-O5: O6's rounding draws fresh noise every step, which a
// replay cannot) | O6 and O6 + 8-bit state, recomputed, with the widened
// step chunked through ATen's kernel, beside amp's one kernel | O5 and O6,
// recomputed, with the head and loss through amp::linear_cross_entropy
// (gpt) - in float16 and bfloat16 (O4-O6: bfloat16 only), every row but
// LibTorch's own step's with amp's fused AdamW (native and FP32 too: the
// same optimizer everywhere). Prints Markdown tables: the mean step of one
// window of steps with one sync at its end (CUDA events), speedup over the
// table's first row, ratio to native autocast, peak allocated memory, host
// syncs per step counted as tools/bench/gpu_peer.py counts Python's (CUDA's
// sync debug mode warns at each synchronizing call; the warnings are
// counted) and, for amp's rows, amp's own count (amp::host_syncs, which also
// counts its waits on events, which the debug mode does not see), steps
// skipped and the final loss (a diverged row cannot pass as fast), and the
// transformers' model FLOP utilisation against the card's measured bf16
// matmul throughput.
//
// Then the fp8 property's GEMMs (with gpt) at the transformer's shapes: one
// Linear layer's training step (forward, both gradients, AdamW) at O5 and
// at O5+fp8 with every GEMM in float8, the GEMM's intensity (multiply-adds
// per element quantized, which Fp8Scaling::min_gemm_intensity compares),
// and the bare float8 kernel's throughput as a fraction of the card's
// float8 ceiling (an 8192^3 _scaled_mm) - what float8 can give, and what
// amp's scaling and casts leave of it, with the device operations (kernels,
// memsets, copies) each step launches; and the same per Linear layer from
// 768 x 3072 to 8192 x 28672 (sweep): where float8 pays.
//
//   gpu_benchmarks [warmup_steps=10] [timed_steps=50] [models=resnet,gpt,small_batch,te_layers,loss,sweep]
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>
#include <amp/linear_cross_entropy.h>
#include <amp/testing.h>

#include "common/char_transformer.h"
#include "bench_util.h"  // median
#include "loss_layer_peer.h"
#ifdef AMP_BENCH_CUDA_KERNELS
#include "optim/widened_step_kernels.h"  // the chunked rows' switch
#endif

#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

// --- Models -------------------------------------------------------------------------

struct BasicBlockImpl : torch::nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(out));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(out));
    if (stride != 1 || in != out) {
      down = register_module("down", torch::nn::Sequential(
          torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)), torch::nn::BatchNorm2d(out)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = bn2(conv2(torch::relu(bn1(conv1(x)))));
    return torch::relu(y + (down ? down->forward(x) : x));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential down{nullptr};
};
TORCH_MODULE(BasicBlock);

struct ResNet18Impl : torch::nn::Module {
  ResNet18Impl() {
    stem = register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 64, 7).stride(2).padding(3).bias(false)));
    bn = register_module("bn", torch::nn::BatchNorm2d(64));
    blocks = register_module("blocks", torch::nn::Sequential());
    int64_t in = 64;
    for (int64_t width : {64, 128, 256, 512}) {
      blocks->push_back(BasicBlock(in, width, width == 64 ? 1 : 2));
      blocks->push_back(BasicBlock(width, width, 1));
      in = width;
    }
    fc = register_module("fc", torch::nn::Linear(512, 1000));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::max_pool2d(torch::relu(bn(stem(x))), 3, 2, 1);
    h = blocks->forward(h);
    return fc(torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1));
  }
  torch::nn::Conv2d stem{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet18);

// --- Harness ---------------------------------------------------------------------------

enum class Mode {
  kFp32, kFp32Tf32, kNative, kO1, kO2, kO2Recompute, kO3, kO4, kO5, kO5Fp8, kO5Fp8All, kO5Recompute, kO6Recompute,
  kO6Recompute8Bit, kO6RecomputeChunked, kO6Recompute8BitChunked, kO1Own, kO2Own, kO5RecomputeFusedLoss,
  kO6RecomputeFusedLoss
};
const char* name(Mode m) {
  switch (m) {
    case Mode::kFp32: return "FP32 (TF32 off)";
    case Mode::kFp32Tf32: return "FP32 (TF32 on)";
    case Mode::kO4: return "amp O4";
    case Mode::kO5: return "amp O5";
    case Mode::kO5Fp8: return "amp O5+fp8";
    case Mode::kO5Fp8All: return "amp O5+fp8, every GEMM in float8";
    case Mode::kO5Recompute: return "amp O5, blocks recomputed";
    case Mode::kO6Recompute: return "amp O6, blocks recomputed";
    case Mode::kO6Recompute8Bit: return "amp O6 + 8-bit state, blocks recomputed";
    case Mode::kO6RecomputeChunked: return "amp O6, blocks recomputed, step chunked (ATen's kernel)";
    case Mode::kO6Recompute8BitChunked: return "amp O6 + 8-bit state, blocks recomputed, step chunked (ATen's kernel)";
    case Mode::kNative: return "native autocast + GradScaler loop";
    case Mode::kO1: return "amp O1";
    case Mode::kO2: return "amp O2";
    case Mode::kO2Recompute: return "amp O2, blocks recomputed";
    case Mode::kO3: return "amp O3";
    case Mode::kO5RecomputeFusedLoss: return "amp O5, blocks recomputed, fused loss (amp::linear_cross_entropy)";
    case Mode::kO6RecomputeFusedLoss: return "amp O6, blocks recomputed, fused loss (amp::linear_cross_entropy)";
    case Mode::kO1Own: return "amp O1, LibTorch's own step";
    case Mode::kO2Own: return "amp O2, LibTorch's own step";
  }
  return "?";
}

// The head and its loss through amp::linear_cross_entropy: the logits never
// held whole (the transformers' blocks recomputed too).
bool has_fused_loss(Mode m) { return m == Mode::kO5RecomputeFusedLoss || m == Mode::kO6RecomputeFusedLoss; }

bool is_recomputed(Mode m) {
  return m == Mode::kO2Recompute || m == Mode::kO5Recompute || m == Mode::kO6Recompute || m == Mode::kO6Recompute8Bit ||
         m == Mode::kO6RecomputeChunked || m == Mode::kO6Recompute8BitChunked || has_fused_loss(m);
}

// O6's widened step through the chunked path amp's one-kernel step replaces
// (widened copies, ATen's _fused_adamw_, then rounding and coding kernels):
// the reference its row is measured beside.
bool is_chunked(Mode m) { return m == Mode::kO6RecomputeChunked || m == Mode::kO6Recompute8BitChunked; }

// A table row: a mode, eager or its whole step (forward, scale_loss, step)
// captured once in a CUDA graph and replayed (amp's levels).
struct Row {
  Mode mode;
  bool graphed = false;
};
std::string name(const Row& row) {
  return std::string(name(row.mode)) + (row.graphed ? ", step in a CUDA graph" : "");
}

// Every mode eagerly, and each amp level with amp's fused step in a graph.
std::vector<Row> all_rows() {
  std::vector<Row> rows;
  for (Mode mode : {Mode::kFp32, Mode::kFp32Tf32, Mode::kNative, Mode::kO1, Mode::kO2, Mode::kO2Recompute,
                    Mode::kO5Recompute, Mode::kO6Recompute, Mode::kO6Recompute8Bit, Mode::kO3, Mode::kO4, Mode::kO5,
                    Mode::kO5Fp8, Mode::kO5Fp8All, Mode::kO1Own, Mode::kO2Own, Mode::kO5RecomputeFusedLoss,
                    Mode::kO6RecomputeFusedLoss}) {
    rows.push_back({mode});
  }
  for (Mode mode : {Mode::kO1, Mode::kO2, Mode::kO3, Mode::kO4, Mode::kO5, Mode::kO5Fp8}) rows.push_back({mode, true});
#ifdef AMP_BENCH_CUDA_KERNELS  // without amp's kernels every widened step is chunked
  for (Mode mode : {Mode::kO6RecomputeChunked, Mode::kO6Recompute8BitChunked}) rows.push_back({mode});
#endif
  return rows;
}

struct Workload {
  std::string name;
  std::function<std::shared_ptr<torch::nn::Module>()> make;
  std::function<std::shared_ptr<torch::nn::Module>()> make_recomputed;  // null: no such row
  std::function<std::shared_ptr<torch::nn::Module>()> make_fused_loss;  // recomputed, fused loss; null: no such row
  std::function<at::Tensor(torch::nn::Module&, int64_t step)> loss;  // forward + loss
  double flops_per_step = 0;  // 0: not reported
  std::vector<Row> rows = all_rows();
  std::vector<at::ScalarType> lows = {at::kHalf, at::kBFloat16};
};

struct Result {
  double ms = 0;
  double peak_gib = 0;
  double syncs_per_step = 0;      // by CUDA's sync debug mode, every row alike
  double amp_reads_per_step = -1;  // amp::host_syncs (amp's rows; -1: not amp)
  int64_t skipped = 0;     // steps skipped in the timed window
  double final_loss = 0;   // so that a row that diverged cannot pass as fast
};

// Counts a region's host syncs as Python's peer does: CUDA's sync debug mode
// warns at every synchronizing call (memcpy to the host, a stream's
// synchronize), and this handler counts those warnings. Backward's warnings
// on autograd's device threads are replayed on the calling thread when
// backward ends, so they reach it too.
class SyncCounter final : public c10::WarningHandler {
 public:
  SyncCounter() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  }
  ~SyncCounter() override {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    c10::WarningUtils::set_warning_handler(previous_);
  }
  SyncCounter(const SyncCounter&) = delete;
  SyncCounter& operator=(const SyncCounter&) = delete;
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("synchronizing CUDA operation") != std::string::npos) {
      ++count_;
    } else {
      previous_->process(warning);
    }
  }
  int64_t count() const { return count_; }

 private:
  c10::WarningHandler* previous_;
  int64_t count_ = 0;
};

// The anchor: LibTorch's own autocast around forward and a GradScaler written
// by hand with the same ATen kernels GradScaler uses.
struct NativeScaler {
  at::Tensor scale = torch::full({1}, 65536.0f, torch::kCUDA);
  at::Tensor tracker = torch::zeros({1}, torch::TensorOptions(torch::kCUDA).dtype(torch::kInt));
  int64_t skipped = 0;
  void step(torch::optim::Optimizer& optimizer, const at::Tensor& loss) {
    (loss.to(at::kFloat) * scale).backward();
    auto found_inf = torch::zeros({1}, torch::kCUDA);
    const auto inv = scale.to(at::kDouble).reciprocal().to(at::kFloat);
    std::map<int, std::vector<at::Tensor>> by_dtype;
    for (const auto& g : optimizer.param_groups()) {
      for (const auto& p : g.params()) {
        if (p.grad().defined()) by_dtype[static_cast<int>(p.grad().scalar_type())].push_back(p.grad());
      }
    }
    for (auto& [dtype, grads] : by_dtype) at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv);
    if (found_inf.item<float>() == 0) {
      optimizer.step();
    } else {
      ++skipped;
    }
    at::_amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000);
  }
};

Result measure(const Workload& w, Row row, at::ScalarType low, int warmup, int timed) {
  const Mode mode = row.mode;
#ifdef AMP_BENCH_CUDA_KERNELS
  struct ChunkedSteps {
    explicit ChunkedSteps(bool chunked) { amp::detail::set_widened_steps_fused(!chunked); }
    ~ChunkedSteps() { amp::detail::set_widened_steps_fused(true); }
  } chunked_steps(is_chunked(mode));
#endif
  // A graph captures off the default stream; its warm-up runs there too.
  std::optional<c10::cuda::CUDAStreamGuard> side;
  if (row.graphed) side.emplace(c10::cuda::getStreamFromPool());
  torch::manual_seed(0);
  const bool recomputed = is_recomputed(mode);
  auto model = has_fused_loss(mode) ? w.make_fused_loss() : recomputed ? w.make_recomputed() : w.make();
  model->to(torch::kCUDA);
  const bool fp32 = mode == Mode::kFp32 || mode == Mode::kFp32Tf32;
  const bool amp_mode = !fp32 && mode != Mode::kNative;
  const bool fused = mode != Mode::kO1Own && mode != Mode::kO2Own;
  at::globalContext().setAllowTF32CuBLAS(mode == Mode::kFp32Tf32);
  at::globalContext().setAllowTF32CuDNN(mode == Mode::kFp32Tf32);
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  // O3 keeps AdamW's state in float16, where the default eps (1e-8) is 0.
  const double eps = mode == Mode::kO3 && low == at::kHalf ? 1e-4 : 1e-8;
  const auto adamw = torch::optim::AdamWOptions(1e-4).eps(eps);
  if (fused) optimizer = std::make_shared<amp::optim::FusedAdamW>(model->parameters(), adamw);
  if (!fused) optimizer = std::make_shared<torch::optim::AdamW>(model->parameters(), adamw);
  amp::Handle handle;
  if (amp_mode) {
    amp::Options options = mode == Mode::kO1 || mode == Mode::kO1Own   ? amp::O1
                           : mode == Mode::kO2 || mode == Mode::kO2Own ||
                                     mode == Mode::kO2Recompute
                               ? amp::O2
                           : mode == Mode::kO4                         ? amp::O4
                           : mode == Mode::kO6Recompute || mode == Mode::kO6Recompute8Bit ||
                                     is_chunked(mode) || mode == Mode::kO6RecomputeFusedLoss
                               ? amp::O6
                           : mode == Mode::kO5 || mode == Mode::kO5Fp8 || mode == Mode::kO5Fp8All ||
                                     mode == Mode::kO5Recompute || mode == Mode::kO5RecomputeFusedLoss
                               ? amp::O5
                               : amp::O3;
    if (mode == Mode::kO5Fp8 || mode == Mode::kO5Fp8All) options.fp8 = true;
    if (mode == Mode::kO5Fp8All) options.fp8_scaling.min_gemm_intensity = 0;
    if (mode == Mode::kO6Recompute8Bit || mode == Mode::kO6Recompute8BitChunked) options.optimizer_state_dtype = at::kByte;
    options.verbosity = 0;
    options.cuda_dtype = low;
    if (mode == Mode::kO3) options.loss_scale = amp::LossScale::Dynamic();
    handle.initialize(model, optimizer, options);
  }
  NativeScaler native;
  at::Tensor last_loss;
  auto step = [&](int64_t i) {
    optimizer->zero_grad();
    if (mode == Mode::kNative) {
      at::autocast::set_autocast_dtype(at::kCUDA, low);
      at::autocast::set_autocast_enabled(at::kCUDA, true);
      last_loss = w.loss(*model, i);
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      at::autocast::clear_cache();
      native.step(*optimizer, last_loss);
    } else if (fp32) {
      last_loss = w.loss(*model, i);
      last_loss.backward();
      optimizer->step();
    } else {
      last_loss = w.loss(*model, i);
      {
        amp::scale_loss scaled(last_loss, optimizer);
        scaled.backward();
      }
      optimizer->step();
    }
  };
  for (int i = 0; i < warmup; ++i) step(i);
  std::optional<at::cuda::CUDAGraph> graph;
  if (row.graphed) {
    (void)amp::skipped_steps(*optimizer);  // the warm-up's outcome known before capturing
    graph.emplace();
    graph->capture_begin();
    step(warmup);
    graph->capture_end();
  }
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  // One window of `timed` steps and one sync at its end: the host runs
  // ahead unless something makes it wait, which the sync count shows.
  const int64_t syncs_before = amp::host_syncs();
  const int64_t skipped_before = amp_mode ? amp::skipped_steps(*optimizer) : native.skipped;
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  start.record();
  int64_t syncs = 0;
  {
    SyncCounter counter;
    for (int i = 0; i < timed; ++i) graph ? graph->replay() : step(warmup + i);
    syncs = counter.count();
  }
  stop.record();
  stop.synchronize();
  Result result;
  result.ms = start.elapsed_time(stop) / timed;
  result.peak_gib = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak / double(1 << 30);
  result.syncs_per_step = double(syncs) / timed;
  if (amp_mode) result.amp_reads_per_step = double(amp::host_syncs() - syncs_before) / timed;
  result.skipped = (amp_mode ? amp::skipped_steps(*optimizer) : native.skipped) - skipped_before;
  result.final_loss = last_loss.item<double>();
  return result;
}

// Mean milliseconds of `fn` over `timed` calls after `warmup`, by CUDA events.
double time_ms(int warmup, int timed, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  start.record();
  for (int i = 0; i < timed; ++i) fn();
  stop.record();
  stop.synchronize();
  return start.elapsed_time(stop) / timed;
}

// TFLOP/s of the bare float8 GEMM [rows, in] x [in, out] (bfloat16 out).
double scaled_mm_tflops(int64_t rows, int64_t in, int64_t out) {
  const auto cuda = torch::TensorOptions(torch::kCUDA);
  const at::Tensor a = torch::randn({rows, in}, cuda).to(at::kFloat8_e4m3fn);
  const at::Tensor b = torch::randn({out, in}, cuda).to(at::kFloat8_e4m3fn).t();
  const at::Tensor one = torch::ones({}, cuda);
  const double ms = time_ms(3, 20, [&] { at::_scaled_mm(a, b, one, one, std::nullopt, std::nullopt, at::kBFloat16); });
  return 2.0 * rows * in * out / (ms / 1e3) / 1e12;
}

// The device operations (kernels, memsets, copies) one call of `fn` puts on
// the GPU, counted by LibTorch's profiler.
int64_t device_ops(const std::function<void()>& fn) {
  namespace profiler = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const profiler::ProfilerConfig config(profiler::ProfilerState::KINETO, /*report_input_shapes=*/false,
                                        /*profile_memory=*/false);
  const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  fn();
  torch::cuda::synchronize();
  const std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  return std::count_if(result->events().begin(), result->events().end(),
                       [](const auto& e) { return e.deviceType() == c10::DeviceType::CUDA; });
}

struct LayerStep {
  double ms;
  int64_t device_ops;
};

// One Linear(in, out) layer's training step on [rows, in] at O5, with and
// without the fp8 property: milliseconds, and the device operations of one
// step.
LayerStep linear_step(int64_t rows, int64_t in, int64_t out, bool fp8) {
  torch::nn::Linear layer(in, out);
  layer->to(torch::kCUDA);
  auto optimizer = std::make_shared<amp::optim::FusedAdamW>(layer->parameters(), torch::optim::AdamWOptions(1e-4));
  amp::Options options = amp::O5;
  options.fp8 = fp8;
  options.fp8_scaling.min_gemm_intensity = 0;  // float8 itself, whatever the rule would choose
  options.verbosity = 0;
  amp::Handle handle;
  handle.initialize(layer, optimizer, options);
  const at::Tensor x = torch::randn({rows, in}, torch::kCUDA);
  const auto step = [&] {
    optimizer->zero_grad();
    {
      amp::scale_loss scaled(layer->forward(x).to(at::kFloat).mean(), optimizer);
      scaled.backward();
    }
    optimizer->step();
  };
  const double ms = time_ms(5, 20, step);
  return {ms, device_ops(step)};
}

struct GemmShape {
  const char* name;
  int64_t in, out;
};

// One row per shape at 8192 tokens: the bare float8 GEMM's throughput, and a
// Linear layer's training step at O5 and O5+fp8.
void fp8_gemm_rows(const char* title, const std::vector<GemmShape>& shapes) {
  if (at::cuda::getCurrentDeviceProperties()->major * 10 + at::cuda::getCurrentDeviceProperties()->minor < 89) {
    std::printf("\nfloat8 GEMMs: this GPU has no float8 kernel (compute capability 8.9+)\n");
    return;
  }
  const double ceiling = scaled_mm_tflops(8192, 8192, 8192);
  std::printf("\n%s (8192 tokens); float8 ceiling (8192^3 _scaled_mm) %.0f TFLOP/s\n| GEMM | in x out | "
              "intensity | bare float8 TFLOP/s | of the ceiling | layer step O5 ms | O5+fp8 ms | speedup | "
              "device ops/step O5 | O5+fp8 |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n", title, ceiling);
  for (const GemmShape& g : shapes) {
    const double tflops = scaled_mm_tflops(8192, g.in, g.out);
    const LayerStep o5 = linear_step(8192, g.in, g.out, false), fp8 = linear_step(8192, g.in, g.out, true);
    const double m = 8192, k = static_cast<double>(g.in), n = static_cast<double>(g.out);
    std::printf("| %s | %lld x %lld | %.0f | %.0f | %.0f%% | %.3f | %.3f | %.2f | %lld | %lld |\n", g.name,
                static_cast<long long>(g.in), static_cast<long long>(g.out), m * k * n / (m * k + k * n + m * n),
                tflops, 100 * tflops / ceiling, o5.ms,
                fp8.ms, o5.ms / fp8.ms, static_cast<long long>(o5.device_ops), static_cast<long long>(fp8.device_ops));
    std::fflush(stdout);
  }
}

void fp8_gemm_table() {
  fp8_gemm_rows("float8 GEMMs at the transformer's shapes",
                {{"attention qkv", 768, 2304}, {"attention out", 768, 768}, {"MLP up", 768, 3072},
                 {"MLP down", 3072, 768}, {"output layer", 768, 50304}});
}

// Where float8 starts to pay: Linear layers from GPT-2-small's MLP to a
// 70B-class model's (Transformer Engine's quickstart layer is 4096 x 16384;
// torchao's sweep finds float8 0.80x bf16 at 1024 x 2048 and 1.39x at
// 4096 x 16384). tools/bench/gpu_peer.py times torchao's float8 at the same
// shapes.
void fp8_sweep_table() {
  fp8_gemm_rows("float8 per Linear, sweep",
                {{"GPT-2 MLP up", 768, 3072}, {"1024 x 4096", 1024, 4096}, {"2048 x 8192", 2048, 8192},
                 {"TE layer MLP up", 4096, 16384}, {"TE layer MLP down", 16384, 4096},
                 {"70B-class MLP up", 8192, 28672}});
}

double bf16_matmul_tflops() {
  const auto a = torch::randn({8192, 8192}, torch::TensorOptions(torch::kCUDA).dtype(torch::kBFloat16));
  for (int i = 0; i < 3; ++i) torch::mm(a, a);
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  start.record();
  for (int i = 0; i < 20; ++i) torch::mm(a, a);
  stop.record();
  stop.synchronize();
  return 20 * 2.0 * 8192.0 * 8192.0 * 8192.0 / (start.elapsed_time(stop) / 1e3) / 1e12;
}

// The output layer and its mean cross-entropy alone at GPT-2-small's step
// (8192 tokens, width 768, vocabulary 50304; hidden states and weight in
// bfloat16, held before it), forward and backward: the peak allocated above
// the inputs (the bfloat16 gradients of both included, which every way
// makes) and the median time of `repeats` after one warm-up, by CUDA events;
// amp::linear_cross_entropy beside ATen's linear + cross_entropy and the
// Python peers (tools/bench/loss_layer_peer.py: the same in Python, under
// torch.compile, torchtune's chunked upcast, Liger Kernel's fused linear
// cross-entropy) on the same inputs' shapes, in the same run.
void loss_layer_table(int repeats) {
  const int64_t tokens = 8 * 1024, width = 768, vocab = 50304, window = 8192;
  std::printf("\nThe output layer and its loss alone (%lld tokens, width %lld, vocabulary %lld, bfloat16), forward and "
              "backward: peak allocated above its inputs, median of %d\n| loss | peak MiB | / unfused | ms | / unfused | "
              "loss |\n|---|---:|---:|---:|---:|---:|\n",
              (long long)tokens, (long long)width, (long long)vocab, repeats);
  torch::manual_seed(0);
  const auto cuda = torch::TensorOptions(torch::kCUDA);
  const at::Tensor h = torch::randn({tokens, width}, cuda).to(at::kBFloat16).requires_grad_();
  const at::Tensor w = (torch::randn({vocab, width}, cuda) * 0.02).to(at::kBFloat16).requires_grad_();
  const at::Tensor y = torch::randint(0, vocab, {tokens}, cuda.dtype(torch::kLong));
  const std::vector<std::pair<std::string, std::function<at::Tensor()>>> ways = {
      {"linear + cross_entropy (ATen)", [&] { return torch::cross_entropy_loss(at::linear(h, w).to(at::kFloat), y); }},
      {"amp::linear_cross_entropy (chunks of " + std::to_string(amp::default_loss_chunk_tokens(tokens, vocab)) +
           " tokens)",
       [&] { return amp::linear_cross_entropy(h, w, {}, y); }},
      {"amp::linear_cross_entropy, chunks of 1024 tokens", [&] { return amp::linear_cross_entropy(h, w, {}, y, {}, 1024); }},
      {"amp::linear_cross_entropy, vocabulary in windows of " + std::to_string(window) + " (chunks of " +
           std::to_string(amp::default_loss_chunk_tokens(tokens, window)) + " tokens)",
       [&] { return amp::linear_cross_entropy(h, w, {}, y, {}, 0, window); }}};
  double unfused_mib = 0, unfused_ms = 0;
  for (const auto& [name, loss_of] : ways) {
    std::vector<double> ms;
    double mib = 0, loss = 0;
    for (int i = 0; i <= repeats; ++i) {  // the first: warm-up
      h.mutable_grad().reset();
      w.mutable_grad().reset();
      torch::cuda::synchronize();
      c10::cuda::CUDACachingAllocator::resetPeakStats(0);
      const int64_t before = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
      at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
      start.record();
      const at::Tensor l = loss_of();
      l.backward();
      stop.record();
      stop.synchronize();
      if (i > 0) ms.push_back(start.elapsed_time(stop));
      mib = (c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak - before) / 1048576.0;
      loss = l.item<double>();
    }
    if (unfused_ms == 0) unfused_mib = mib, unfused_ms = bench::median(ms);
    std::printf("| %s | %.1f | %.3f | %.2f | %.2f | %.5f |\n", name.c_str(), mib, mib / unfused_mib, bench::median(ms),
                bench::median(ms) / unfused_ms, loss);
    std::fflush(stdout);
  }
  h.mutable_grad().reset();
  w.mutable_grad().reset();
  bench::print_loss_layer_peers(AMP_PEER_PYTHON, AMP_SOURCE_DIR "/tools/bench/loss_layer_peer.py", "cuda", tokens,
                                width, vocab, {unfused_mib, unfused_ms, 2, true});
}

}  // namespace

// A transformer workload of the examples' model: next-token loss over
// `batch` random sequences; the model FLOPs of a step (6 per parameter per
// token, and attention's) for the MFU column.
Workload transformer(std::string name, examples::TransformerConfig config, int64_t batch) {
  examples::TransformerConfig recomputed = config;
  recomputed.recompute = true;
  examples::TransformerConfig fused_loss = recomputed;
  fused_loss.fused_loss = true;
  const double w = static_cast<double>(config.width), tokens = static_cast<double>(batch * config.context);
  const double params = config.layers * 12.0 * w * w + 2.0 * config.vocab * w + config.context * w;
  Workload out{std::move(name), [config] { return std::make_shared<examples::CharTransformerImpl>(config); },
               [recomputed] { return std::make_shared<examples::CharTransformerImpl>(recomputed); },
               [fused_loss] { return std::make_shared<examples::CharTransformerImpl>(fused_loss); },
               [config, batch](torch::nn::Module& m, int64_t) {
                 const auto tokens = torch::randint(0, config.vocab, {batch, config.context + 1},
                                                    torch::TensorOptions(torch::kCUDA).dtype(torch::kLong));
                 auto& model = static_cast<examples::CharTransformerImpl&>(m);
                 if (model.config.fused_loss) {
                   return model.loss(tokens.narrow(1, 0, config.context), tokens.narrow(1, 1, config.context));
                 }
                 const auto logits = model.forward(tokens.narrow(1, 0, config.context));
                 return torch::cross_entropy_loss(logits.reshape({-1, config.vocab}),
                                                  tokens.narrow(1, 1, config.context).reshape({-1}));
               },
               6 * params * tokens + 12.0 * config.layers * w * config.context * tokens};
  return out;
}

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "gpu_benchmarks: no CUDA device\n");
    return 2;
  }
  const int warmup = argc > 1 ? std::stoi(argv[1]) : 10, timed = argc > 2 ? std::stoi(argv[2]) : 50;
  std::set<std::string> models;
  {
    std::stringstream list(argc > 3 ? argv[3] : "resnet,gpt,small_batch,te_layers,loss,sweep");
    for (std::string m; std::getline(list, m, ',');) models.insert(m);
  }
  at::globalContext().setBenchmarkCuDNN(true);

  std::vector<Workload> workloads;
  if (models.count("gpt")) {
    // The vocabulary padded to a multiple of 64, as nanoGPT does; beside
    // it, once, GPT-2's own (tools/bench/gpu_peer.py times both).
    workloads.push_back(transformer("GPT-2-small shape (12 x 768, 12 heads), seq 1024, batch 8, vocabulary 50304",
                                    {50304, 1024, 768, 12, 12}, 8));
    Workload unpadded = transformer("The same with vocabulary 50257 (unpadded)", {50257, 1024, 768, 12, 12}, 8);
    unpadded.rows = {{Mode::kNative}, {Mode::kO2}};
    workloads.push_back(std::move(unpadded));
  }
  if (models.count("small_batch")) {
    // Where launches, not arithmetic, take the step: what a graph saves.
    Workload small = transformer("GPT-2-small shape, seq 128, batch 1 (a small step)", {50304, 128, 768, 12, 12}, 1);
    small.rows = {{Mode::kNative}, {Mode::kO1}, {Mode::kO2}, {Mode::kO5}, {Mode::kO1, true}, {Mode::kO2, true},
                  {Mode::kO5, true}};
    small.lows = {at::kBFloat16};
    workloads.push_back(std::move(small));
  }
  if (models.count("te_layers")) {
    // Transformer Engine's quickstart layer (hidden 4096, FFN 16384, 32
    // heads, sequence 2048, batch 4), four of them, between a 256-symbol
    // embedding and output layer.
    Workload te = transformer(
        "Transformer Engine's quickstart layer x 4 (4096, FFN 16384, 32 heads), seq 2048, batch 4",
        {256, 2048, 4096, 32, 4}, 4);
    te.rows = {{Mode::kFp32Tf32}, {Mode::kNative}, {Mode::kO2}, {Mode::kO5}, {Mode::kO5Fp8}, {Mode::kO5Fp8All},
               {Mode::kO5, true}, {Mode::kO5Fp8All, true}};
    te.lows = {at::kBFloat16};
    workloads.push_back(std::move(te));
  }
  if (models.count("resnet")) {
    Workload resnet{"ResNet-18, batch 256, 3x224x224", [] { return std::make_shared<ResNet18Impl>(); }, nullptr, nullptr,
                    [](torch::nn::Module& m, int64_t) {
                      const auto x = torch::randn({256, 3, 224, 224}, torch::kCUDA);
                      const auto y = torch::randint(0, 1000, {256}, torch::TensorOptions(torch::kCUDA).dtype(torch::kLong));
                      return torch::cross_entropy_loss(static_cast<ResNet18Impl&>(m).forward(x), y);
                    }};
    // No transformer blocks to recompute, no GEMM large enough for float8.
    const auto transformer_only = [](const Row& r) {
      return is_recomputed(r.mode) || r.mode == Mode::kO5Fp8All;
    };
    resnet.rows.erase(std::remove_if(resnet.rows.begin(), resnet.rows.end(), transformer_only), resnet.rows.end());
    workloads.push_back(std::move(resnet));
  }
  const double ceiling = bf16_matmul_tflops();
  std::printf("amp GPU benchmarks - %s, LibTorch %s; measured bf16 matmul ceiling %.0f TFLOP/s; "
              "mean step of one %d-step window (one sync at its end) after %d warm-up steps\n",
              at::cuda::getCurrentDeviceProperties()->name, TORCH_VERSION, ceiling, timed, warmup);
  for (const auto& w : workloads) {
    for (at::ScalarType low : w.lows) {
      std::printf("\n%s, low precision %s\n", w.name.c_str(), c10::toString(low));
      std::printf("| mode | step ms | speedup vs first row | ratio to native | peak GiB | peak / first row | "
                  "host syncs/step | amp's host reads/step | skipped | final loss |%s\n", w.flops_per_step ? " MFU |" : "");
      std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|%s\n", w.flops_per_step ? "---:|" : "");
      std::optional<Result> first, native;
      for (const Row& row : w.rows) {
        const bool bf16_level = row.mode == Mode::kO4 || row.mode == Mode::kO5 || row.mode == Mode::kO5Fp8 ||
                                row.mode == Mode::kO5Fp8All || row.mode == Mode::kO5Recompute ||
                                row.mode == Mode::kO6Recompute || row.mode == Mode::kO6Recompute8Bit ||
                                has_fused_loss(row.mode);
        if (bf16_level && low != at::kBFloat16) continue;
        if (is_recomputed(row.mode) && !w.make_recomputed) continue;
        if (has_fused_loss(row.mode) && !w.make_fused_loss) continue;
        const Result res = measure(w, row, low, warmup, timed);
        if (!first) first = res;
        if (row.mode == Mode::kNative) native = res;
        char reads[32] = "-", to_native[32] = "-";
        if (res.amp_reads_per_step >= 0) std::snprintf(reads, sizeof reads, "%.2f", res.amp_reads_per_step);
        if (native) std::snprintf(to_native, sizeof to_native, "%.3f", res.ms / native->ms);
        std::printf("| %s | %.1f | %.2f | %s | %.2f | %.2f | %.2f | %s | %lld | %.3f |", name(row).c_str(), res.ms,
                    first->ms / res.ms, to_native, res.peak_gib, res.peak_gib / first->peak_gib, res.syncs_per_step,
                    reads, static_cast<long long>(res.skipped), res.final_loss);
        if (w.flops_per_step) std::printf(" %.1f%% |", 100 * w.flops_per_step / (res.ms / 1e3) / 1e12 / ceiling);
        std::printf("\n");
        std::fflush(stdout);  // each row as it is measured
      }
    }
  }
  if (models.count("loss")) loss_layer_table(5);
  if (models.count("gpt")) fp8_gemm_table();
  if (models.count("sweep")) fp8_sweep_table();
  return 0;
}
