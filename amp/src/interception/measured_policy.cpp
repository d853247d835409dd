// SPDX-License-Identifier: BSD-3-Clause
#include <amp/measured_policy.h>

#include "interception/measured_policy.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/hash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace amp {
namespace detail {
namespace {

using ChoiceKey = std::tuple<std::string, int, std::string, std::string>;  // op, device, shapes, low

struct Table {
  std::mutex mutex;
  std::map<ChoiceKey, MeasuredChoice> choices;
  // Bumped where choices are cleared or replaced; a memo of an older
  // generation is emptied before it answers.
  std::atomic<uint64_t> generation{0};
};

Table& table() {
  static Table* t = new Table();  // lives past static destruction: kernels may still ask
  return *t;
}

struct ShapeKeyHash {
  size_t operator()(const ShapeKey& key) const {
    size_t h = key.size();
    for (int64_t v : key) h = c10::hash_combine(h, std::hash<int64_t>()(v));
    return h;
  }
};

// Set when this thread's memo is destroyed (its exit; the main thread's
// comes before static destructors, which may still run a GEMM): from then on
// the thread asks the table itself.
thread_local bool t_memo_gone = false;

// This thread's decided keys: op -> (device, low dtype, shapes) -> dtype.
struct Memo {
  uint64_t generation = 0;
  std::unordered_map<std::string, std::unordered_map<ShapeKey, at::ScalarType, ShapeKeyHash>> by_op;
  ~Memo() { t_memo_gone = true; }
};

void synchronize(c10::Device device) {
  if (!device.is_cpu()) c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
}

double elapsed_ms(const std::function<void()>& run) {
  const auto start = std::chrono::steady_clock::now();
  run();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// The fastest of a few runs of each, after one untimed run of each (which
// fills caches: the weights' casts, cuDNN's algorithms, oneDNN's
// primitives), the two interleaved so that a busy moment of a shared
// machine slows both alike.
std::pair<double, double> fastest_ms(const std::function<void()>& low, const std::function<void()>& fp32) {
  constexpr int kRuns = 5;
  elapsed_ms(low);
  elapsed_ms(fp32);
  double best_low = 0, best_fp32 = 0;
  for (int i = 0; i < kRuns; ++i) {
    const double l = elapsed_ms(low), f = elapsed_ms(fp32);
    best_low = i == 0 ? l : std::min(best_low, l);
    best_fp32 = i == 0 ? f : std::min(best_fp32, f);
  }
  return {best_low, best_fp32};
}

// float32 must win by this much: under timing noise, autocast's choice stands.
constexpr double kMargin = 0.95;

at::ScalarType decide(const std::string& op, c10::Device device, const std::string& shapes, at::ScalarType low,
                      c10::function_ref<void(at::ScalarType)> run, const MeasuredPolicyTimer* timer) {
  const ChoiceKey key{op, static_cast<int>(device.type()), shapes, c10::toString(low)};
  Table& t = table();
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    if (auto it = t.choices.find(key); it != t.choices.end()) return it->second.keeps_fp32 ? at::kFloat : low;
  }
  MeasuredChoice choice{op, device.type(), shapes, c10::toString(low)};
  {
    // The timing runs draw nothing from the program's random streams
    // (attention's dropout): the generator's state is put back after them.
    at::Generator generator = at::globalContext().defaultGenerator(device);
    const at::Tensor rng_state = generator.get_state();
    const std::function<void()> run_low = [&] { run(low); synchronize(device); };
    const std::function<void()> run_fp32 = [&] { run(at::kFloat); synchronize(device); };
    std::tie(choice.low_ms, choice.fp32_ms) =
        timer && *timer ? (*timer)(op, shapes, run_low, run_fp32) : fastest_ms(run_low, run_fp32);
    generator.set_state(rng_state);
  }
  choice.keeps_fp32 = choice.fp32_ms < kMargin * choice.low_ms;
  std::lock_guard<std::mutex> lock(t.mutex);
  // A thread that measured the same key first decided: its choice stands.
  const MeasuredChoice& kept = t.choices.emplace(key, choice).first->second;
  return kept.keeps_fp32 ? at::kFloat : low;
}

}  // namespace

bool is_measured_op(const std::string& op) {
  static const std::set<std::string> ops = {
      "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::matmul",
      "aten::linear", "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution",
      "aten::_convolution", "aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d",
      "aten::conv_tbc", "aten::prelu", "aten::scaled_dot_product_attention"};
  const std::string base = op.substr(0, op.find('.'));  // "aten::conv2d.padding" -> "aten::conv2d"
  return ops.count(base) != 0;
}

at::ScalarType measured_dtype(const std::string& op, c10::Device device, ShapeKey shapes, at::ScalarType low,
                              c10::function_ref<std::string()> describe_shapes,
                              c10::function_ref<void(at::ScalarType)> run, const MeasuredPolicyTimer* timer) {
  if (C10_UNLIKELY(t_memo_gone)) return decide(op, device, describe_shapes(), low, run, timer);
  thread_local Memo memo;
  const uint64_t generation = table().generation.load(std::memory_order_acquire);
  if (memo.generation != generation) {
    memo.by_op.clear();
    memo.generation = generation;
  }
  shapes.push_back(static_cast<int64_t>(device.type()));
  shapes.push_back(static_cast<int64_t>(low));
  auto& decided = memo.by_op[op];
  if (auto it = decided.find(shapes); it != decided.end()) return it->second;
  // A table cleared or loaded from here on empties this memo at its next call.
  const at::ScalarType dtype = decide(op, device, describe_shapes(), low, run, timer);
  decided.emplace(std::move(shapes), dtype);
  return dtype;
}

}  // namespace detail

std::vector<MeasuredChoice> measured_policy() {
  detail::Table& t = detail::table();
  std::lock_guard<std::mutex> lock(t.mutex);
  std::vector<MeasuredChoice> out;
  for (const auto& [key, choice] : t.choices) out.push_back(choice);
  return out;
}

std::string format_measured_policy(const std::vector<MeasuredChoice>& choices) {
  std::ostringstream out;
  out << "| op | device | shapes | low dtype | low ms | float32 ms | runs in |\n|---|---|---|---|---:|---:|---|\n";
  char times[64];
  for (const MeasuredChoice& c : choices) {
    std::snprintf(times, sizeof times, "%.4f | %.4f", c.low_ms, c.fp32_ms);
    out << "| " << c.op << " | " << c10::DeviceTypeName(c.device, /*lower_case=*/true) << " | " << c.shapes
        << " | " << c.low << " | " << times << " | " << (c.keeps_fp32 ? "Float (faster)" : c.low) << " |\n";
  }
  return out.str();
}

void clear_measured_policy() {
  detail::Table& t = detail::table();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.choices.clear();
  t.generation.fetch_add(1, std::memory_order_release);
}

// One choice per line, tab-separated: op, device, shapes, low, low_ms, fp32_ms, keeps_fp32.
void save_measured_policy(const std::string& path) {
  std::ofstream file(path);
  TORCH_CHECK(file, "amp::save_measured_policy: cannot write ", path, "; check the directory exists and is writable.");
  for (const MeasuredChoice& c : measured_policy()) {
    file << c.op << '\t' << static_cast<int>(c.device) << '\t' << c.shapes << '\t' << c.low << '\t' << c.low_ms
         << '\t' << c.fp32_ms << '\t' << (c.keeps_fp32 ? 1 : 0) << '\n';
  }
  TORCH_CHECK(file.good(), "amp::save_measured_policy: writing ", path, " failed.");
}

void load_measured_policy(const std::string& path) {
  std::ifstream file(path);
  TORCH_CHECK(file, "amp::load_measured_policy: cannot read ", path, ".");
  std::map<detail::ChoiceKey, MeasuredChoice> loaded;
  std::string line;
  for (int number = 1; std::getline(file, line); ++number) {
    std::istringstream fields(line);
    MeasuredChoice c;
    std::string device, low_ms, fp32_ms, keeps;
    const bool read = std::getline(fields, c.op, '\t') && std::getline(fields, device, '\t') &&
                      std::getline(fields, c.shapes, '\t') && std::getline(fields, c.low, '\t') &&
                      std::getline(fields, low_ms, '\t') && std::getline(fields, fp32_ms, '\t') &&
                      std::getline(fields, keeps) && (keeps == "0" || keeps == "1");
    TORCH_CHECK(read, "amp::load_measured_policy: line ", number, " of ", path, " is not one "
                "amp::save_measured_policy writes (op, device, shapes, low dtype, two times, 0 or 1, "
                "tab-separated); nothing was loaded.");
    c.device = static_cast<c10::DeviceType>(std::stoi(device));
    c.low_ms = std::stod(low_ms);
    c.fp32_ms = std::stod(fp32_ms);
    c.keeps_fp32 = keeps == "1";
    loaded[{c.op, static_cast<int>(c.device), c.shapes, c.low}] = c;
  }
  detail::Table& t = detail::table();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.choices = std::move(loaded);
  t.generation.fetch_add(1, std::memory_order_release);
}

}  // namespace amp
