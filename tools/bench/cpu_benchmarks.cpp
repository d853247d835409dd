// SPDX-License-Identifier: BSD-3-Clause
// amp's CPU benchmarks, each a table of figures measured side by side in one
// run (medians of repeated measurements, interleaved so drift hits every
// column alike):
//   1. dispatch overhead per op: no autocast vs native at::autocast vs amp O1;
//   2. loss-scaler step cost, 200 parameter tensors: amp vs the same ATen
//      sequence by hand vs a naive per-tensor loop with a host sync each;
//   3. O2 master-weight step cost: amp vs the same fused ATen sequence by hand,
//      with the number of foreach/_amp_ calls per step;
//   4. peak memory of one Fashion-MNIST CNN training step at O0-O3;
//   5. Adam step with overflow check: amp's fused step vs amp with LibTorch's
//      own step vs the same sequences by hand, with host syncs per step;
//   6. the character transformer's training step (transformer_lm's model,
//      batch 32 x 64): FP32 vs LibTorch's native at::autocast in bfloat16
//      vs amp O1 - amp's share of O1's time is its distance from native;
//   7. the fp8 property's host cost: four small Linear layers' training
//      step at O5 and O5+fp8, with the ATen calls per step - on a GPU each
//      is a launch, and at small shapes the host's work is the step's time.
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>
#include <amp/testing.h>

#include "bench_util.h"
#include "common/char_transformer.h"
#include "common/fashion_mnist_net.h"

#include <absl/flags/flag.h>
#include <absl/flags/parse.h>
#include <absl/flags/usage.h>
#include <ATen/autocast_mode.h>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <cstdio>
#include <optional>
#include <map>
#include <unordered_map>
#include <mutex>

ABSL_FLAG(int, repetitions, 15, "repetitions per measurement (the median is reported)");
ABSL_FLAG(int, calls, 20000, "op calls per dispatch measurement");
ABSL_FLAG(int, scaler_params, 200, "parameter tensors in the scaler benchmarks");
ABSL_FLAG(std::string, only, "", "run one section: dispatch, scaler, master, memory, fused, transformer, fp8");

namespace {

using bench::median;

amp::Options quiet(amp::OptLevel level) {
  amp::Options o = level;
  o.verbosity = 0;
  return o;
}

// --- 1. Dispatch overhead -------------------------------------------------------

struct OpCase {
  std::string name;
  std::string policy;
  std::function<void()> call;
};

void dispatch_overhead() {
  const int calls = absl::GetFlag(FLAGS_calls), reps = absl::GetFlag(FLAGS_repetitions);
  const auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  const auto a_low = a.to(at::kBFloat16), b_low = b.to(at::kBFloat16);
  const auto weight = torch::randn({4, 4}, torch::requires_grad()), bias = torch::randn({4}, torch::requires_grad());
  torch::NoGradGuard no_grad;  // measure dispatch, not graph building
  std::vector<OpCase> cases = {
      {"mm fp32 (casts)", "lower_precision", [&] { at::mm(a, b); }},
      {"mm bf16 (no cast)", "lower_precision", [&] { at::mm(a_low, b_low); }},
      {"linear, cached weight", "lower_precision", [&] { at::linear(a, weight, bias); }},
      {"cat bf16+fp32", "promote", [&] { at::cat({a_low, b}); }},
      {"softmax", "not intercepted on CPU", [&] { at::softmax(a, 1); }},
      {"relu", "not intercepted", [&] { at::relu(a); }},
  };
  enum Mode { kPlain, kNative, kAmp, kModes };
  std::vector<std::vector<std::vector<double>>> t(cases.size(), std::vector<std::vector<double>>(kModes));
  for (int r = 0; r < reps; ++r) {
    for (int mode = 0; mode < kModes; ++mode) {
      std::unique_ptr<amp::Handle> handle;
      if (mode == kNative) at::autocast::set_autocast_enabled(at::kCPU, true);
      if (mode == kAmp) {
        handle = std::make_unique<amp::Handle>();
        handle->initialize(std::vector<std::shared_ptr<torch::nn::Module>>{}, {}, quiet(amp::O1));
      }
      for (size_t c = 0; c < cases.size(); ++c) {
        cases[c].call();  // warm: caches filled
        t[c][mode].push_back(bench::ns_per_call(cases[c].call, calls));
      }
      if (mode == kNative) at::autocast::set_autocast_enabled(at::kCPU, false);
    }
  }
  std::printf("\n1. Dispatch overhead per call, 4x4 CPU tensors, no_grad (median of %d x %d calls)\n", reps, calls);
  std::printf("| op | amp policy | no autocast ns | native autocast ns | amp O1 ns | amp / native | amp added / native added |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|\n");
  for (size_t c = 0; c < cases.size(); ++c) {
    const double plain = median(t[c][kPlain]), native = median(t[c][kNative]), ours = median(t[c][kAmp]);
    const double added_native = native - plain, added_amp = ours - plain;
    char added[32] = "-";
    if (added_native > 20) std::snprintf(added, sizeof(added), "%.2f", added_amp / added_native);
    std::printf("| %s | %s | %.0f | %.0f | %.0f | %.2f | %s |\n", cases[c].name.c_str(),
                cases[c].policy.c_str(), plain, native, ours, ours / native, added);
  }
  // The boxed path: an op registered by name (users' own ops take it).
  std::vector<double> boxed, typed_or_plain;
  amp::register_half_function("aten::relu");
  for (int r = 0; r < reps; ++r) {
    typed_or_plain.push_back(bench::ns_per_call([&] { at::relu(a_low); }, calls));
    amp::Handle handle;
    handle.initialize(std::vector<std::shared_ptr<torch::nn::Module>>{}, {}, quiet(amp::O1));
    boxed.push_back(bench::ns_per_call([&] { at::relu(a_low); }, calls));
  }
  amp::reset_user_registrations();
  std::printf("| relu bf16, registered by name (boxed kernel) | lower_precision | %.0f | - | %.0f | - | - |\n",
              median(typed_or_plain), median(boxed));
}

// --- 2. Loss scaler step cost -----------------------------------------------

std::vector<at::Tensor> make_params(int n, at::ScalarType dtype = at::kFloat) {
  std::vector<at::Tensor> params;
  for (int i = 0; i < n; ++i) params.push_back(torch::randn({64, 64}).to(dtype).requires_grad_());
  return params;
}

void assign_grads(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
}

void scaler_cost() {
  const int n = absl::GetFlag(FLAGS_scaler_params), reps = absl::GetFlag(FLAGS_repetitions) * 40;
  auto params = make_params(n);
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(torch::randn_like(p) * 1e-3);
  const auto loss = torch::tensor(1.0f);
  // Every variant ends with the same plain SGD update (lr 0), so differences
  // to the baseline are the scaler's own cost. Gradients are copied in
  // (standing in for backward) before the clock starts: what is timed is
  // the unscale, the overflow check, the scale update and the step.
  torch::optim::SGD plain(params, 0.0);
  at::Tensor scale = torch::full({1}, 65536.0f), tracker = torch::zeros({1}, at::kInt);
  auto fresh_grads = [&] {
    plain.zero_grad();
    assign_grads(params, grads);
  };
  auto hand_written = [&] {
    auto found_inf = torch::zeros({1});
    const auto inv_scale = scale.to(at::kDouble).reciprocal().to(at::kFloat);
    std::vector<at::Tensor> g;
    for (const auto& p : params) g.push_back(p.grad());
    at::_amp_foreach_non_finite_check_and_unscale_(g, found_inf, inv_scale);
    at::_amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000);
    if (found_inf.item<float>() == 0) plain.step();
  };
  auto naive_loop = [&] {
    const double s = scale.item<double>();
    bool overflow = false;
    for (const auto& p : params) {
      p.grad().mul_(1.0 / s);
      overflow = overflow || !p.grad().isfinite().all().item<bool>();  // a host sync per tensor
    }
    if (!overflow) plain.step();
  };
  // All four are measured in every repetition, so drift on a shared machine
  // reaches every row alike (the ops they run are not in amp's cast lists).
  std::vector<double> base, amp_t, hand, naive;
  int64_t amp_syncs = 0;
  amp::Handle handle;
  // The scaler's cost around LibTorch's own step (section 5: fused).
  std::shared_ptr<torch::optim::Optimizer> optimizer = std::make_shared<torch::optim::SGD>(params, 0.0);
  handle.initialize({}, {optimizer}, quiet(amp::O1));
  std::optional<amp::scale_loss> guard;
  for (int r = 0; r < reps; ++r) {
    base.push_back(bench::ns_once(fresh_grads, [&] { plain.step(); }));
    const int64_t syncs_before = amp::host_syncs();
    amp_t.push_back(bench::ns_once(
        [&] {
          optimizer->zero_grad();
          guard.emplace(loss, optimizer);
          assign_grads(params, grads);
        },
        [&] {
          guard.reset();  // the guard's end: unscale, check, update the scale
          optimizer->step();
        }));
    amp_syncs += amp::host_syncs() - syncs_before;
    hand.push_back(bench::ns_once(fresh_grads, hand_written));
    naive.push_back(bench::ns_once(fresh_grads, naive_loop));
  }
  const double b = median(base);
  std::printf("\n2. Loss-scaler cost per step, %d fp32 tensors of 64x64 (median of %d steps, baseline %.0f us removed)\n",
              n, reps, b / 1e3);
  std::printf("| variant | scaler us/step | ratio to hand-written | host syncs/step |\n|---|---:|---:|---:|\n");
  const double h = median(hand) - b;
  std::printf("| amp scale_loss + step | %.1f | %.2f | %.0f |\n", (median(amp_t) - b) / 1e3,
              (median(amp_t) - b) / h, static_cast<double>(amp_syncs) / reps);
  std::printf("| hand-written ATen sequence | %.1f | 1.00 | 1 |\n", h / 1e3);
  std::printf("| naive per-tensor loop | %.1f | %.2f | %d |\n", (median(naive) - b) / 1e3, (median(naive) - b) / h, n + 1);
}

// --- 3. O2 master-weight step ---------------------------------------------------

// A model of `n` parameters, so that O2 keeps them as float32 masters.
struct ParamsModel : torch::nn::Module {
  explicit ParamsModel(int n) {
    for (int i = 0; i < n; ++i) register_parameter("p" + std::to_string(i), torch::randn({64, 64}));
  }
};

void master_cost() {
  const int n = absl::GetFlag(FLAGS_scaler_params), reps = absl::GetFlag(FLAGS_repetitions) * 40;
  std::vector<at::Tensor> grads;
  for (int i = 0; i < n; ++i) grads.push_back((torch::randn({64, 64}) * 1e-3).to(at::kBFloat16));
  const auto loss = torch::tensor(1.0f);
  std::vector<double> amp_t, hand;
  int64_t amp_calls = 0, hand_calls = 0;
  // By hand: a bf16 model, fp32 masters stepped by SGD, the model refreshed
  // from them before the next forward.
  auto params = make_params(n, at::kBFloat16);
  std::vector<at::Tensor> masters;
  for (const auto& p : params) masters.push_back(p.detach().to(at::kFloat).requires_grad_());
  torch::optim::SGD master_sgd(masters, 0.0);
  at::Tensor scale = torch::full({1}, 65536.0f), tracker = torch::zeros({1}, at::kInt);
  auto hand_step = [&] {
    {
      torch::NoGradGuard no_grad;
      at::_foreach_copy_(params, masters);
    }
    assign_grads(params, grads);  // stands in for backward
    std::vector<at::Tensor> model_grads, master_grads;
    for (size_t i = 0; i < params.size(); ++i) {
      model_grads.push_back(params[i].grad());
      masters[i].mutable_grad() = at::empty_like(masters[i]);
      master_grads.push_back(masters[i].grad());
    }
    at::_foreach_copy_(master_grads, model_grads);
    auto found_inf = torch::zeros({1});
    at::_amp_foreach_non_finite_check_and_unscale_(master_grads, found_inf,
                                                   scale.to(at::kDouble).reciprocal().to(at::kFloat));
    at::_amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000);
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    if (found_inf.item<float>() == 0) master_sgd.step();
  };
  {
    amp::Handle handle;
    auto model = std::make_shared<ParamsModel>(n);
    torch::optim::SGD sgd(model->parameters(), 0.0);
    handle.initialize(model, sgd, quiet(amp::O2));
    const auto model_params = model->parameters();
    // The guard lowers the masters (as a forward would), backward's bf16
    // gradients arrive, the guard's end unscales them into float32 and
    // returns the masters to rest; then the program's own SGD steps them.
    auto amp_step = [&] {
      {
        amp::scale_loss scaled(loss, sgd);
        assign_grads(model_params, grads);  // stands in for backward
      }
      sgd.step();
    };
    for (int r = 0; r < reps; ++r) {
      amp_t.push_back(bench::ns_once([&] { sgd.zero_grad(); }, amp_step));
      hand.push_back(bench::ns_once([&] { master_sgd.zero_grad(); }, hand_step));
    }
    bench::OpCounter amp_counter({"aten::_foreach", "aten::_amp"});
    sgd.zero_grad();
    amp_step();
    amp_calls = amp_counter.count();
  }
  {
    bench::OpCounter hand_counter({"aten::_foreach", "aten::_amp"});
    hand_step();
    hand_calls = hand_counter.count();
  }
  std::printf("\n3. O2 master-weight step, %d fp32 masters of 64x64 lowered to bf16, SGD (median of %d steps)\n", n, reps);
  std::printf("| variant | us/step | ratio to hand-written | foreach/_amp_ ATen calls per step |\n|---|---:|---:|---:|\n");
  std::printf("| amp O2 (lower, guard, step) | %.1f | %.2f | %lld |\n", median(amp_t) / 1e3,
              median(amp_t) / median(hand), static_cast<long long>(amp_calls));
  std::printf("| hand-written fused sequence | %.1f | 1.00 | %lld |\n", median(hand) / 1e3,
              static_cast<long long>(hand_calls));
}

// --- 4. Peak memory of a training step -----------------------------------------

// Wraps LibTorch's CPU allocator to track live and peak bytes. Keeps its
// pointers "simple" (data == context), as oneDNN's raw allocations require.
class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* base) : base_(base), base_free_(base->raw_deleter()) {
    instance_ = this;
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    const c10::Device device = inner.device();
    void* data = inner.release_context();  // now ours to free, via base_free_
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = n;
      live_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, live_);
    }
    return {data, data, &TrackingAllocator::release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &TrackingAllocator::release; }
  void copy_data(void* dest, const void* src, size_t count) const override { base_->copy_data(dest, src, count); }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_ = live_;
  }
  int64_t peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }

 private:
  static void release(void* data) {
    TrackingAllocator* self = instance_;
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      auto it = self->sizes_.find(data);
      if (it != self->sizes_.end()) {
        self->live_ -= static_cast<int64_t>(it->second);
        self->sizes_.erase(it);
      }
    }
    self->base_free_(data);
  }
  static inline TrackingAllocator* instance_ = nullptr;
  c10::Allocator* base_;
  c10::DeleterFnPtr base_free_;
  std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;
  int64_t live_ = 0, peak_ = 0;
};

TrackingAllocator* g_tracker = nullptr;

void peak_memory() {
  std::printf("\n4. Fashion-MNIST CNN, one training step at batch 128 on CPU (bf16), Adam: bytes allocated\n");
  std::printf("| level | weights + optimizer state MiB | peak during a step MiB | peak / O0 |\n|---|---:|---:|---:|\n");
  double o0 = 0;
  for (amp::OptLevel level : {amp::O0, amp::O1, amp::O2, amp::O3}) {
    torch::manual_seed(0);
    const auto x = torch::randn({128, 1, 28, 28});
    const auto y = torch::randint(0, 10, {128});
    examples::FashionNet model;
    std::shared_ptr<torch::optim::Optimizer> optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-3);
    amp::Handle handle;
    std::tie(model, optimizer) = handle.initialize(model, optimizer, quiet(level));
    auto step = [&] {
      optimizer->zero_grad();
      const auto loss = torch::cross_entropy_loss(model->forward(x), y);
      {
        amp::scale_loss scaled(loss, optimizer);
        scaled.backward();
      }
      optimizer->step();
    };
    step();  // creates the optimizer state
    optimizer->zero_grad();
    g_tracker->reset_peak();
    const int64_t resident = g_tracker->peak();
    step();
    const double peak = (g_tracker->peak() - resident) / 1048576.0;
    if (level == amp::O0) o0 = peak;
    std::printf("| %s | %.1f | %.1f | %.2f |\n", amp::to_string(level), resident / 1048576.0, peak, peak / o0);
  }
}

}  // namespace

// --- 5. Fused optimizer step ---------------------------------------------------

void fused_step_cost() {
  const int n = absl::GetFlag(FLAGS_scaler_params), reps = absl::GetFlag(FLAGS_repetitions) * 20;
  auto params = make_params(n);
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(torch::randn_like(p) * 1e-3);
  const auto loss = torch::tensor(1.0f);
  // Hand-written: the scaler's ATen calls, then Adam - fused on the device
  // flag, or LibTorch's own Adam after reading it.
  at::Tensor scale = torch::full({1}, 65536.0f), tracker = torch::zeros({1}, at::kInt);
  auto check_and_update = [&] {
    auto found_inf = torch::zeros({1});
    std::vector<at::Tensor> g;
    for (const auto& p : params) g.push_back(p.grad());
    at::_amp_foreach_non_finite_check_and_unscale_(g, found_inf, scale.reciprocal());
    at::_amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000);
    return found_inf;
  };
  std::vector<at::Tensor> exp_avgs, exp_avg_sqs, steps;
  for (const auto& p : params) {
    exp_avgs.push_back(torch::zeros_like(p));
    exp_avg_sqs.push_back(torch::zeros_like(p));
    steps.push_back(torch::zeros({}));
  }
  torch::optim::Adam own_adam(params, 1e-3);
  auto hand_fused = [&] {
    assign_grads(params, grads);
    const auto found_inf = check_and_update();
    at::NoGradGuard no_grad;
    at::_foreach_add_(steps, (1 - found_inf).reshape({}));
    std::vector<at::Tensor> g;
    for (const auto& p : params) g.push_back(p.grad());
    at::_fused_adam_(params, g, exp_avgs, exp_avg_sqs, {}, steps, 1e-3, 0.9, 0.999, 0, 1e-8, false, false,
                     std::nullopt, found_inf);
  };
  auto hand_own = [&] {
    assign_grads(params, grads);
    if (check_and_update().item<float>() == 0) own_adam.step();  // the host sync
  };
  auto zero = [&] { own_adam.zero_grad(); };
  // amp's two variants cannot be initialized at once: they take turns in
  // blocks, each initializing a fresh Adam, with the baseline and both
  // hand-written sequences measured in every block, so drift on a shared
  // machine reaches every row alike.
  std::vector<double> base, by_hand_fused, by_hand_own, by_amp[2];
  int64_t syncs[2] = {0, 0};
  const int blocks = 10, per_block = std::max(1, reps / (2 * blocks));
  for (int block = 0; block < blocks; ++block) {
    for (int fused = 1; fused >= 0; --fused) {
      amp::Handle handle;
      std::shared_ptr<torch::optim::Optimizer> optimizer;
      if (fused == 1) optimizer = std::make_shared<amp::optim::FusedAdam>(params, 1e-3);
      if (fused == 0) optimizer = std::make_shared<torch::optim::Adam>(params, 1e-3);
      handle.initialize({}, {optimizer}, quiet(amp::O1));
      auto amp_step = [&] {
        {
          amp::scale_loss scaled(loss, optimizer);
          assign_grads(params, grads);  // stands in for backward
        }
        optimizer->step();
      };
      amp_step();  // untimed: the first step creates the optimizer's state
      optimizer->zero_grad();
      for (int r = 0; r < per_block; ++r) {
        base.push_back(bench::ns_once(zero, [&] { assign_grads(params, grads); }));
        const int64_t before = amp::host_syncs();
        by_amp[fused].push_back(bench::ns_once([&] { optimizer->zero_grad(); }, amp_step));
        syncs[fused] += amp::host_syncs() - before;
        by_hand_fused.push_back(bench::ns_once(zero, hand_fused));
        by_hand_own.push_back(bench::ns_once(zero, hand_own));
      }
    }
  }
  const int steps_each = blocks * per_block;
  const double b = median(base), h = median(by_hand_fused) - b;
  std::printf("\n5. Adam step with overflow check, %d fp32 tensors of 64x64 (median of %d steps, the %.0f us "
              "gradient copy common to all removed)\n", n, steps_each, b / 1e3);
  std::printf("| variant | us/step | ratio to hand-written fused | host syncs/step |\n|---|---:|---:|---:|\n");
  auto row = [&](const char* name, const std::vector<double>& t, double syncs_per_step) {
    std::printf("| %s | %.1f | %.2f | %.0f |\n", name, (median(t) - b) / 1e3, (median(t) - b) / h, syncs_per_step);
  };
  row("amp, amp::optim::FusedAdam", by_amp[1], static_cast<double>(syncs[1]) / steps_each);
  row("amp, torch::optim::Adam", by_amp[0], static_cast<double>(syncs[0]) / steps_each);
  row("hand-written: _amp_ calls + _fused_adam_ on the flag", by_hand_fused, 0);
  row("hand-written: _amp_ calls + host read + torch::optim::Adam", by_hand_own, 1);
}

void transformer_step() {
  torch::manual_seed(0);
  examples::CharTransformer model;
  auto optimizer = std::make_shared<torch::optim::AdamW>(model->parameters(), 1e-3);
  const at::Tensor windows = torch::randint(0, 256, {32, 65}, at::kLong);
  const at::Tensor inputs = windows.narrow(1, 0, 64), targets = windows.narrow(1, 1, 64).reshape({-1});
  auto loss_of_forward = [&] { return torch::cross_entropy_loss(model->forward(inputs).reshape({-1, 256}), targets); };
  auto fp32_step = [&] {
    optimizer->zero_grad();
    loss_of_forward().backward();
    optimizer->step();
  };
  auto native_step = [&] {
    optimizer->zero_grad();
    at::Tensor loss;
    {
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      at::autocast::set_autocast_enabled(at::kCPU, true);
      loss = loss_of_forward();
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    }
    loss.backward();
    optimizer->step();
  };
  auto amp_step = [&] {
    optimizer->zero_grad();
    {
      amp::scale_loss scaled(loss_of_forward(), optimizer);
      scaled.backward();
    }
    optimizer->step();
  };
  // amp and native autocast cannot be on at once. Each variant runs a run
  // of steps in a row - two untimed, to reach its own steady state (a step
  // right after another variant's pays for the allocator's other block
  // sizes: up to 15% here), then five timed - and the variants take turns
  // in rotating order, so drift on a shared machine reaches each alike.
  std::vector<double> fp32, native, by_amp;
  const int blocks = std::max(3, absl::GetFlag(FLAGS_repetitions) / 2);
  auto run = [](const std::function<void()>& step, std::vector<double>& times) {
    step(), step();
    for (int i = 0; i < 5; ++i) times.push_back(bench::ns_once([] {}, step));
  };
  for (int block = 0; block < blocks; ++block) {
    for (int turn = 0; turn < 3; ++turn) {
      switch ((block + turn) % 3) {
        case 0: run(fp32_step, fp32); break;
        case 1: run(native_step, native); break;
        default: {
          amp::Handle handle;
          handle.initialize(model, optimizer, quiet(amp::O1));
          run(amp_step, by_amp);
        }
      }
    }
  }
  const double n = median(native);
  std::printf("\n6. Character transformer training step (2 blocks, width 64, batch 32 x 64, AdamW; median of %d "
              "steps each)\n| variant | ms/step | ratio to native autocast |\n|---|---:|---:|\n",
              5 * blocks);
  std::printf("| FP32 | %.2f | %.2f |\n", median(fp32) / 1e6, median(fp32) / n);
  std::printf("| native at::autocast, bfloat16 | %.2f | 1.00 |\n", n / 1e6);
  std::printf("| amp O1 (bfloat16) | %.2f | %.2f |\n", median(by_amp) / 1e6, median(by_amp) / n);
}

void fp8_host_cost() {
  torch::manual_seed(0);
  torch::nn::Sequential layers(torch::nn::Linear(64, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64));
  const at::Tensor x = torch::randn({64, 64});
  std::vector<double> times[2];
  int64_t ops[2] = {0, 0}, launches[2] = {0, 0};
  const int blocks = std::max(3, absl::GetFlag(FLAGS_repetitions) / 2), per_block = 20;
  for (int block = 0; block < blocks; ++block) {
    for (int fp8 = 0; fp8 < 2; ++fp8) {
      auto optimizer = std::make_shared<amp::optim::FusedAdamW>(layers->parameters(), torch::optim::AdamWOptions(1e-4));
      amp::Options options = quiet(amp::O5);
      options.fp8 = fp8 == 1;
      amp::Handle handle;
      handle.initialize(layers, optimizer, options);
      auto step = [&] {
        optimizer->zero_grad();
        {
          amp::scale_loss scaled(layers->forward(x).to(at::kFloat).mean(), optimizer);
          scaled.backward();
        }
        optimizer->step();
      };
      step(), step();  // past the first iteration's scale, into the steady state
      if (block == 0) {
        bench::OpCounter counter({"aten::"});
        bench::LaunchCounter kernels;
        step();
        ops[fp8] = counter.count();
        launches[fp8] = kernels.count();
      }
      for (int i = 0; i < per_block; ++i) times[fp8].push_back(bench::ns_once([] {}, step));
    }
  }
  std::printf("\n7. fp8 host cost: 4 x Linear(64, 64) training step on 64 rows, FusedAdamW (median of %d steps each)\n"
              "| variant | us/step | ATen calls/step | of them, kernel launches on a GPU |\n|---|---:|---:|---:|\n",
              blocks * per_block);
  for (int fp8 = 0; fp8 < 2; ++fp8) {
    std::printf("| amp O5%s | %.1f | %lld | %lld |\n", fp8 ? "+fp8" : "", median(times[fp8]) / 1e3,
                static_cast<long long>(ops[fp8]), static_cast<long long>(launches[fp8]));
  }
}

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("amp CPU benchmarks: dispatch overhead, scaler cost, O2 step, memory.");
  absl::ParseCommandLine(argc, argv);
  static TrackingAllocator tracker(c10::GetDefaultCPUAllocator());
  g_tracker = &tracker;
  c10::SetCPUAllocator(&tracker, /*priority=*/100);
  torch::set_num_threads(1);  // steadier timings on a shared 2-core machine
  const std::string only = absl::GetFlag(FLAGS_only);
  std::printf("amp CPU benchmarks - LibTorch %s, %d intra-op thread(s)\n", TORCH_VERSION, torch::get_num_threads());
  if (only.empty() || only == "dispatch") dispatch_overhead();
  if (only.empty() || only == "scaler") scaler_cost();
  if (only.empty() || only == "master") master_cost();
  if (only.empty() || only == "memory") peak_memory();
  if (only.empty() || only == "fused") fused_step_cost();
  if (only.empty() || only == "transformer") transformer_step();
  if (only.empty() || only == "fp8") fp8_host_cost();
  return 0;
}
