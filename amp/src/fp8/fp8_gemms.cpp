// SPDX-License-Identifier: BSD-3-Clause
#include "fp8/fp8_gemms.h"

#include "support/host_read.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <tuple>
#include <utility>
#include <vector>

namespace amp::detail {

Fp8Gemms::Fp8Gemms(const Options::Fp8Scaling& recipe, bool tally)
    : recipe_(recipe),
      tally_(tally),
      forward_(at::kFloat8_e4m3fn),
      backward_(recipe.format == Options::Fp8Scaling::Format::kHybrid ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn) {}

namespace {

// Calibrated on an H200 (options.h, BENCHMARKS.md).
constexpr double kCudaMinGemmIntensity = 3000;

}  // namespace

bool Fp8Gemms::choose(const at::Tensor& input, int64_t out, const c10::TensorImpl* layer) {
  // Every qualifying GEMM asks: numbers only here, the words when asked.
  Choice c;
  c.in = input.size(-1);
  c.rows = c.in > 0 ? input.numel() / c.in : 0;
  c.out = out;
  const double rows = static_cast<double>(c.rows), in = static_cast<double>(c.in), outs = static_cast<double>(out);
  const double elements = rows * in + in * outs + rows * outs;
  c.intensity = elements > 0 ? rows * in * outs / elements : 0;
  c.least = recipe_.min_gemm_intensity.value_or(input.is_cuda() ? kCudaMinGemmIntensity : 0);
  c.fits = fp8_shapes_fit(input, out);
  const bool float8 = c.fits && c.intensity >= c.least;
  std::lock_guard<std::mutex> lock(mutex_);
  choices_[layer] = c;
  return float8;
}

std::vector<Fp8LayerChoice> Fp8Gemms::choices(const Names& names) const {
  std::vector<Fp8LayerChoice> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [layer, c] : choices_) {
      auto name = names.find(layer);
      if (name == names.end()) continue;
      Fp8LayerChoice choice;
      choice.layer = name->second;
      choice.float8 = c.fits && c.intensity >= c.least;
      choice.rows = c.rows, choice.in = c.in, choice.out = c.out;
      choice.intensity = c.intensity;
      char reason[96] = "dimensions not multiples of 16 (the CUDA float8 kernel's)";
      if (c.fits) {
        std::snprintf(reason, sizeof reason, "intensity %.0f %s %.0f (min_gemm_intensity)", c.intensity,
                      choice.float8 ? ">=" : "<", c.least);
      }
      choice.reason = reason;
      out.push_back(std::move(choice));
    }
  }
  std::sort(out.begin(), out.end(), [](const Fp8LayerChoice& a, const Fp8LayerChoice& b) { return a.layer < b.layer; });
  return out;
}

std::shared_ptr<Fp8Site> Fp8Gemms::make_site() const {
  return std::make_shared<Fp8Site>(recipe_, forward_, backward_, tally_);
}

std::shared_ptr<Fp8Site> Fp8Gemms::site_for(const c10::TensorImpl* layer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& slot = sites_[layer];
  if (!slot) slot = make_site();
  return slot;
}

at::Tensor Fp8Gemms::linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const c10::TensorImpl* layer, bool rerun) {
  return fp8_linear(input, weight, bias, site_for(layer), rerun);
}

void Fp8Gemms::update() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Fp8Scaler*> due;
  for (auto& [weight, site] : sites_) {
    for (Fp8Scaler* s : {&site->input, &site->weight, &site->grad_output}) {
      if (s->begin_update()) due.push_back(s);
    }
  }
  Fp8Scaler::update_delayed(due);
}

namespace {

constexpr const char* kRoles[] = {"input", "weight", "grad_output"};

// kRoles[i] of a site (const or not).
template <class Site>
auto& role(Site& site, int i) {
  return i == 0 ? site.input : i == 1 ? site.weight : site.grad_output;
}

}  // namespace

void Fp8Gemms::save(torch::serialize::OutputArchive& archive, const Names& names) const {
  std::lock_guard<std::mutex> lock(mutex_);
  torch::serialize::OutputArchive all(archive.compilation_unit());
  int64_t count = 0;
  for (const auto& [layer, site] : sites_) {
    auto name = names.find(layer);
    TORCH_CHECK(name != names.end(), "amp: an fp8 GEMM site belongs to a weight that is not a parameter of "
                "initialize's models; its scales cannot be saved by name.");
    torch::serialize::OutputArchive entry(archive.compilation_unit());
    entry.write("name", c10::IValue(name->second));
    for (int i = 0; i < 3; ++i) {
      torch::serialize::OutputArchive scaler(archive.compilation_unit());
      role(*site, i).save(scaler);
      entry.write(kRoles[i], scaler);
    }
    all.write("site" + std::to_string(count++), entry);
  }
  all.write("count", at::scalar_tensor(count, at::kLong));
  archive.write("fp8", all);
}

void Fp8Gemms::load(torch::serialize::InputArchive& archive, const Names& names) {
  torch::serialize::InputArchive all;
  if (!archive.try_read("fp8", all)) return;  // a state saved without fp8: the scales start afresh
  at::Tensor count;
  TORCH_CHECK(all.try_read("count", count) && count.numel() == 1, "amp: the state's fp8 entry has no count.");
  std::unordered_map<std::string, const c10::TensorImpl*> by_name;
  for (const auto& [impl, name] : names) by_name.emplace(name, impl);
  std::vector<std::pair<const c10::TensorImpl*, torch::serialize::InputArchive>> entries;
  Fp8Site probe(recipe_, forward_, backward_);  // checks entries against the recipe
  for (int64_t i = 0; i < count.item<int64_t>(); ++i) {  // check all before changing any
    torch::serialize::InputArchive entry;
    TORCH_CHECK(all.try_read("site" + std::to_string(i), entry), "amp: the state's fp8 entry lacks site ", i, ".");
    c10::IValue name;
    TORCH_CHECK(entry.try_read("name", name) && name.isString(), "amp: the state's fp8 site ", i, " has no name.");
    auto layer = by_name.find(name.toStringRef());
    TORCH_CHECK(layer != by_name.end(), "amp: the state holds fp8 scales for '", name.toStringRef(), "', which is "
                "no parameter of the models passed to amp::initialize; load it into the same models.");
    for (int r = 0; r < 3; ++r) {
      torch::serialize::InputArchive scaler;
      TORCH_CHECK(entry.try_read(kRoles[r], scaler), "amp: the state's fp8 site '", name.toStringRef(), "' lacks its ",
                  kRoles[r], " scaling.");
      role(probe, r).check_saved(scaler, name.toStringRef() + " (" + kRoles[r] + ")");
    }
    entries.emplace_back(layer->second, std::move(entry));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [layer, entry] : entries) {
    auto& site = sites_[layer];
    if (!site) site = make_site();
    for (int r = 0; r < 3; ++r) {
      torch::serialize::InputArchive scaler;
      entry.read(kRoles[r], scaler);
      role(*site, r).restore(scaler);
    }
  }
}

std::vector<Fp8TensorTelemetry> Fp8Gemms::telemetry(const Names& names) const {
  std::vector<Fp8TensorTelemetry> out;
  std::vector<at::Tensor> recorded;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [layer, site] : sites_) {
      auto name = names.find(layer);
      if (name == names.end()) continue;
      for (int i = 0; i < 3; ++i) {
        const Fp8Scaler& scaler = role(*site, i);
        const Fp8Tally& tally = scaler.completed_tally();
        if (tally.calls == 0) continue;
        Fp8TensorTelemetry t;
        t.layer = name->second;
        t.operand = kRoles[i];
        t.format = scaler.format();
        t.calls = tally.calls;
        t.numel = tally.numel;
        out.push_back(std::move(t));
        recorded.insert(recorded.end(), {tally.counts, tally.amax, tally.scale});
      }
    }
  }
  const std::vector<double> values = read_to_host(recorded);
  for (size_t i = 0; i < out.size(); ++i) {
    const double* v = values.data() + 4 * i;  // saturated, flushed, amax, scale
    out[i].saturated = static_cast<int64_t>(v[0]);
    out[i].flushed = static_cast<int64_t>(v[1]);
    out[i].amax = v[2];
    out[i].scale = v[3];
  }
  std::sort(out.begin(), out.end(), [](const Fp8TensorTelemetry& a, const Fp8TensorTelemetry& b) {
    return std::tie(a.layer, a.operand) < std::tie(b.layer, b.operand);
  });
  return out;
}

int64_t Fp8Gemms::sites() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(sites_.size());
}

std::shared_ptr<Fp8Site> Fp8Gemms::site_of(const at::Tensor& weight) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sites_.find(weight.unsafeGetTensorImpl());
  return it == sites_.end() ? nullptr : it->second;
}

}  // namespace amp::detail
