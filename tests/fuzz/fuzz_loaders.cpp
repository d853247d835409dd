// SPDX-License-Identifier: BSD-3-Clause
// A bounded mutation fuzzer for amp's loaders of untrusted bytes: amp's state
// (amp::load_state) and checkpoints (amp::load_checkpoint, which loads the
// optimizers' state as a transaction). The program's own
// torch::load(optimizer, ...) is LibTorch's.
//
//   fuzz_loaders --executions=2000 --seed=1     what ctest runs
//   fuzz_loaders --write_corpus                 refresh tests/fuzz/corpus
//
// Inputs start from the corpus (valid files of each kind, plus inputs that
// once found a problem) and are mutated structurally (an entry removed,
// added, renamed, or its tensor given another dtype, shape or value) or
// bytewise (bits flipped, bytes overwritten, truncated, extended). Each
// input must be loaded or refused with a c10::Error; when it is refused,
// models, optimizer and every loss scaler must be bit-identical to before;
// when it is accepted, the scalers must hold sane values and one training
// step must run. Before each input it is written to fuzz_last_input.pt, so
// a crash leaves its reproducer behind.
#include <amp/internal/loss_scaling.h>
#include <amp/amp.h>
#include <amp/casting.h>
#include <amp/diagnostics.h>
#include <amp/distributed.h>

#include "fuzz_net.h"

#include <absl/flags/flag.h>
#include <absl/flags/parse.h>

#include <torch/torch.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <sstream>

#include <unistd.h>

ABSL_FLAG(int64_t, executions, 2000, "inputs to run");
ABSL_FLAG(uint64_t, seed, 1, "mutation seed");
ABSL_FLAG(std::string, corpus, AMP_FUZZ_CORPUS, "corpus directory");
ABSL_FLAG(bool, write_corpus, false, "write the valid seed inputs into --corpus and exit");
ABSL_FLAG(std::string, replay, "", "run this one input file (kind from its name prefix) and exit");

namespace {

enum class Kind { kState, kCheckpoint };
const char* prefix(Kind k) { return k == Kind::kState ? "state" : "checkpoint"; }

using Net = amp::fuzz::FuzzNet;

// One live amp setup: O2 (master weights), Adam, two loss scalers.
struct Setup {
  amp::Handle handle;
  Net model;
  std::shared_ptr<torch::optim::Optimizer> optimizer;

  Setup() {
    torch::manual_seed(0);
    optimizer = std::make_shared<torch::optim::Adam>(model->parameters(), 1e-2);
    amp::Options options = amp::O2;
    options.verbosity = 0;
    options.num_losses = 2;
    std::tie(model, optimizer) = handle.initialize(model, optimizer, options);
    for (int i = 0; i < 3; ++i) train_step(i);
  }
  void train_step(int i) {
    torch::manual_seed(100 + i);
    const auto x = torch::randn({8, 4}), y = torch::randn({8, 2});
    optimizer->zero_grad();
    {
      amp::scale_loss scaled(torch::mse_loss(model(x), y), optimizer, {i % 2});
      scaled.backward();
    }
    optimizer->step();
  }
};

std::string to_bytes(const std::function<void(std::ostream&)>& write) {
  std::ostringstream out;
  write(out);
  return out.str();
}

std::string save_kind(Setup& s, Kind kind, const std::string& scratch) {
  switch (kind) {
    case Kind::kState:
      return to_bytes([](std::ostream& out) {
        torch::serialize::OutputArchive archive;
        amp::save_state(archive);
        archive.save_to(out);
      });
    case Kind::kCheckpoint: {
      amp::save_checkpoint(scratch, {s.model.ptr()}, {s.optimizer});
      std::ifstream in(scratch, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    }
  }
  return "";
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// LibTorch's archive reader: amp's state and an optimizer's state reach amp
// already parsed (its errors are LibTorch's: any std::exception).
std::optional<torch::serialize::InputArchive> parse(const std::string& bytes) {
  try {
    std::istringstream in(bytes);
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    return archive;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// amp's loaders: they must refuse with a c10::Error.
void load_kind(Setup& s, Kind kind, torch::serialize::InputArchive* archive, const std::string& bytes,
               const std::string& scratch) {
  switch (kind) {
    case Kind::kState:
      amp::load_state(*archive);
      return;
    case Kind::kCheckpoint:  // amp reads the file itself
      write_file(scratch, bytes);
      amp::load_checkpoint(scratch, {s.model.ptr()}, {s.optimizer});
      return;
  }
}

// Everything a failed load must leave as it was, as tensors.
std::vector<at::Tensor> snapshot(Setup& s) {
  std::vector<at::Tensor> out;
  for (const auto& t : s.model->parameters()) out.push_back(t.detach().clone());
  for (const auto& t : s.model->buffers()) out.push_back(t.detach().clone());
  for (const auto& t : amp::master_params(*s.optimizer)) out.push_back(t.detach().clone());
  for (const auto& group : s.optimizer->param_groups()) out.push_back(torch::tensor(group.options().get_lr()));
  for (const auto& [key, state] : s.optimizer->state()) {
    if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(state.get())) {
      out.push_back(torch::tensor(adam->step()));
      out.push_back(adam->exp_avg().clone());
      out.push_back(adam->exp_avg_sq().clone());
    }
  }
  for (int i = 0; i < 2; ++i) {
    const auto state = amp::internal::live_scaling(i).state();
    out.push_back(state.scale.clone());
    out.push_back(state.growth_tracker.clone());
    out.push_back(state.hysteresis_tracker.clone());
  }
  return out;
}

bool identical(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].scalar_type() != b[i].scalar_type() || a[i].sizes() != b[i].sizes()) return false;
    const auto x = a[i].contiguous(), y = b[i].contiguous();
    if (std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) return false;
  }
  return true;
}

// --- structural mutation: an archive as a tree of entries -------------------

struct Tree {
  std::map<std::string, c10::IValue> values;  // tensors and other values
  std::map<std::string, Tree> children;
};

Tree read_tree(torch::serialize::InputArchive& archive) {
  Tree tree;
  for (const std::string& key : archive.keys()) {
    c10::IValue value;
    if (!archive.try_read(key, value)) continue;
    if (value.isObject()) {
      torch::serialize::InputArchive child;
      if (archive.try_read(key, child)) tree.children[key] = read_tree(child);
    } else {
      tree.values[key] = value;
    }
  }
  return tree;
}

void write_tree(const Tree& tree, torch::serialize::OutputArchive& archive) {
  for (const auto& [key, value] : tree.values) {
    if (value.isTensor()) {
      archive.write(key, value.toTensor());
    } else {
      archive.write(key, value);
    }
  }
  for (const auto& [key, child] : tree.children) {
    torch::serialize::OutputArchive nested(archive.compilation_unit());
    write_tree(child, nested);
    archive.write(key, nested);
  }
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : random_(seed) {}
  int below(int n) { return std::uniform_int_distribution<int>(0, n - 1)(random_); }

  std::string mutate(const std::string& bytes) {
    if (below(2) == 0) {
      if (auto structural = mutate_structure(bytes)) return *structural;
    }
    return mutate_bytes(bytes);
  }

 private:
  std::optional<std::string> mutate_structure(const std::string& bytes) {
    Tree tree;
    try {
      std::istringstream in(bytes);
      torch::serialize::InputArchive archive;
      archive.load_from(in);
      tree = read_tree(archive);
    } catch (const std::exception&) {
      return std::nullopt;  // not an archive (an earlier byte mutation): mutate bytes
    }
    const int rounds = 1 + below(2);
    for (int r = 0; r < rounds; ++r) mutate_tree(tree);
    torch::serialize::OutputArchive out;
    write_tree(tree, out);
    return to_bytes([&](std::ostream& o) { out.save_to(o); });
  }

  void mutate_tree(Tree& tree) {
    // Descend to a random archive, then change one of its entries.
    Tree* node = &tree;
    while (!node->children.empty() && below(3) != 0) {
      auto it = node->children.begin();
      std::advance(it, below(static_cast<int>(node->children.size())));
      node = &it->second;
    }
    const int total = static_cast<int>(node->values.size() + node->children.size());
    const int action = below(10);
    if (total == 0 || action == 0) {
      node->values["unexpected" + std::to_string(below(3))] = at::zeros({2});
      return;
    }
    const int index = below(total);
    if (index >= static_cast<int>(node->values.size())) {  // a child archive
      auto it = node->children.begin();
      std::advance(it, index - node->values.size());
      if (action < 5) {
        node->children.erase(it);
      } else {
        Tree moved = it->second;
        const std::string key = it->first + (action < 8 ? "9" : "");
        node->children.erase(it);
        if (action < 8) node->children[key] = moved;
        else node->values[key] = c10::IValue(std::string("not an archive"));
      }
      return;
    }
    auto it = node->values.begin();
    std::advance(it, index);
    c10::IValue& v = it->second;
    if (action == 1) {
      node->values.erase(it);
    } else if (action == 2) {
      const std::string key = it->first + "7";
      c10::IValue moved = v;
      node->values.erase(it);
      node->values[key] = moved;
    } else if (!v.isTensor() || action == 3) {
      const std::vector<c10::IValue> replacements = {c10::IValue(std::string("O9")), c10::IValue(std::string("")),
                                                     c10::IValue(int64_t{-3}), c10::IValue(1e300),
                                                     c10::IValue(at::tensor({7}, at::kLong)),
                                                     c10::IValue(at::tensor({2.5}))};
      v = replacements[below(static_cast<int>(replacements.size()))];
    } else {
      v = mutate_tensor(v.toTensor());
    }
  }

  at::Tensor mutate_tensor(const at::Tensor& t) {
    switch (below(6)) {
      case 0: {  // another dtype
        const std::vector<at::ScalarType> dtypes = {at::kInt, at::kLong, at::kDouble, at::kFloat,
                                                    at::kBFloat16, at::kHalf, at::kBool, at::kByte};
        return t.to(dtypes[below(static_cast<int>(dtypes.size()))]);
      }
      case 1:  // another shape
        return below(2) ? t.reshape({-1}).repeat({2}) : t.reshape({-1}).slice(0, 0, std::max<int64_t>(0, t.numel() - 1));
      case 2:
        return t.unsqueeze(0);
      default: {  // hostile values
        at::Tensor m = t.clone();
        if (m.numel() == 0) return m;
        const std::vector<double> values = {std::nan(""), INFINITY, -INFINITY, -1, 0, 1e30, -1e9, 3e9};
        try {
          m.reshape({-1})[below(static_cast<int>(m.numel()))] = values[below(static_cast<int>(values.size()))];
        } catch (const std::exception&) {  // not representable in an integer dtype
          m.reshape({-1})[0] = -1;
        }
        return m;
      }
    }
  }

  std::string mutate_bytes(std::string bytes) {
    if (bytes.empty()) return "x";
    switch (below(5)) {
      case 0:  // flip bits
        for (int i = 0, n = 1 + below(8); i < n; ++i) bytes[below(static_cast<int>(bytes.size()))] ^= 1 << below(8);
        break;
      case 1: {  // overwrite a range
        const int at = below(static_cast<int>(bytes.size()));
        for (int i = at; i < std::min<int>(bytes.size(), at + 1 + below(64)); ++i) bytes[i] = static_cast<char>(below(256));
        break;
      }
      case 2:  // truncate
        bytes.resize(below(static_cast<int>(bytes.size())));
        break;
      case 3:  // append
        bytes.append(1 + below(256), static_cast<char>(below(256)));
        break;
      default: {  // duplicate a chunk somewhere else
        const int from = below(static_cast<int>(bytes.size()));
        const std::string chunk = bytes.substr(from, 1 + below(128));
        bytes.insert(below(static_cast<int>(bytes.size())), chunk);
      }
    }
    return bytes;
  }

  std::mt19937_64 random_;
};

struct Input {
  Kind kind;
  std::string bytes;
  std::string name;
};

std::vector<Input> read_corpus(const std::string& dir) {
  std::vector<Input> inputs;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    for (Kind k : {Kind::kState, Kind::kCheckpoint}) {
      if (name.rfind(prefix(k), 0) != 0) continue;
      std::ifstream in(entry.path(), std::ios::binary);
      inputs.push_back({k, std::string(std::istreambuf_iterator<char>(in), {}), name});
    }
  }
  std::sort(inputs.begin(), inputs.end(), [](const Input& a, const Input& b) { return a.name < b.name; });
  return inputs;
}

struct Tally {
  int64_t accepted = 0, refused = 0, unreadable = 0;  // unreadable: refused by LibTorch's reader
  std::map<std::string, int64_t> findings;
  double slowest = 0;
};

// Runs one input; a problem becomes a finding.
void run_one(Setup& s, const Input& input, const std::string& good_checkpoint, const std::string& scratch,
             Tally& tally) {
  write_file("fuzz_last_input.pt", input.bytes);
  const auto before = snapshot(s);
  const auto start = std::chrono::steady_clock::now();
  bool accepted = false;
  std::optional<torch::serialize::InputArchive> archive;
  if (input.kind != Kind::kCheckpoint) {
    archive = parse(input.bytes);
    if (!archive) {
      ++tally.unreadable;
      return;
    }
  }
  try {
    load_kind(s, input.kind, archive ? &*archive : nullptr, input.bytes, scratch);
    accepted = true;
  } catch (const c10::Error& e) {
    if (std::string(e.what_without_backtrace()).empty()) ++tally.findings["refused with an empty message"];
  } catch (const std::exception& e) {
    ++tally.findings[std::string("refused with a non-c10 exception: ") + e.what()];
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  tally.slowest = std::max(tally.slowest, seconds);
  if (seconds > 10) {
    ++tally.findings[std::string(prefix(input.kind)) + ": took over 10 s to load or refuse (kept in fuzz_slow_input.pt)"];
    write_file(std::string("fuzz_slow_input.pt"), input.bytes);
  }
  if (!accepted) {
    ++tally.refused;
    if (!identical(before, snapshot(s))) ++tally.findings[std::string(prefix(input.kind)) + ": refused but changed state"];
    return;
  }
  ++tally.accepted;
  for (int i = 0; i < 2; ++i) {
    const double scale = amp::loss_scaler(i)->scale();
    if (!std::isfinite(scale) || scale <= 0) ++tally.findings[std::string(prefix(input.kind)) + ": accepted a scale of " + std::to_string(scale)];
  }
  try {
    s.train_step(0);
  } catch (const std::exception& e) {
    const auto* c10 = dynamic_cast<const c10::Error*>(&e);
    ++tally.findings[std::string(prefix(input.kind)) + ": accepted, then training failed: " +
                     std::string(c10 ? c10->what_without_backtrace() : e.what()).substr(0, 160) +
                     " (kept in " + prefix(input.kind) + "-finding.pt)"];
    write_file(std::string(prefix(input.kind)) + "-finding.pt", input.bytes);
  }
  amp::load_checkpoint(good_checkpoint, {s.model.ptr()}, {s.optimizer});  // back to the baseline
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string scratch_dir =
      (std::filesystem::temp_directory_path() / ("amp_fuzz_" + std::to_string(getpid()))).string();
  std::filesystem::create_directories(scratch_dir);
  const std::string scratch = scratch_dir + "/input.pt", good = scratch_dir + "/good.pt";
  Setup setup;
  write_file(good, save_kind(setup, Kind::kCheckpoint, scratch));

  if (absl::GetFlag(FLAGS_write_corpus)) {
    for (Kind k : {Kind::kState, Kind::kCheckpoint}) {
      write_file(absl::GetFlag(FLAGS_corpus) + "/" + prefix(k) + "-valid.pt", save_kind(setup, k, scratch));
    }
    return 0;
  }
  std::vector<Input> corpus = read_corpus(absl::GetFlag(FLAGS_corpus));
  if (!absl::GetFlag(FLAGS_replay).empty()) {
    const std::string path = absl::GetFlag(FLAGS_replay);
    std::ifstream in(path, std::ios::binary);
    const std::string name = std::filesystem::path(path).filename().string();
    Kind kind = name.rfind("state", 0) == 0 ? Kind::kState : Kind::kCheckpoint;
    corpus = {{kind, std::string(std::istreambuf_iterator<char>(in), {}), name}};
  }
  if (corpus.empty()) {
    std::cerr << "fuzz_loaders: no corpus files in " << absl::GetFlag(FLAGS_corpus) << "\n";
    return 2;
  }
  Tally tally;
  Mutator mutator(absl::GetFlag(FLAGS_seed));
  const auto start = std::chrono::steady_clock::now();
  for (const Input& input : corpus) run_one(setup, input, good, scratch, tally);  // as they are
  const int64_t executions = absl::GetFlag(FLAGS_replay).empty() ? absl::GetFlag(FLAGS_executions) : 0;
  for (int64_t i = 0; i < executions; ++i) {
    Input input = corpus[mutator.below(static_cast<int>(corpus.size()))];
    input.bytes = mutator.mutate(input.bytes);
    if (mutator.below(4) == 0) input.bytes = mutator.mutate(input.bytes);
    run_one(setup, input, good, scratch, tally);
  }
  std::remove(scratch.c_str());
  std::remove(good.c_str());
  std::remove("fuzz_last_input.pt");
  rmdir(scratch_dir.c_str());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "fuzz_loaders: " << corpus.size() + executions << " executions (" << corpus.size() << " corpus files), "
            << tally.accepted << " accepted, " << tally.refused << " refused by amp, " << tally.unreadable
            << " not readable as archives, slowest " << tally.slowest << " s, "
            << seconds << " s in all\n";
  for (const auto& [finding, n] : tally.findings) std::cout << "FINDING (" << n << "x): " << finding << "\n";
  return tally.findings.empty() ? 0 : 1;
}
