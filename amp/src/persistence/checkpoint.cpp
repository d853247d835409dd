// SPDX-License-Identifier: BSD-3-Clause
#include <amp/checkpoint.h>
#include <amp/internal/level_rules.h>

#include <amp/opt_levels.h>
#include <amp/state.h>

#include "persistence/state_format.h"
#include "session/context.h"
#include "optim/optimizer_state_load.h"
#include "optim/optimizer_kinds.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <unordered_map>

#include <sys/stat.h>
#include <unistd.h>

namespace amp {
namespace {

// With data_parallel.shard: every member's whole float32 master, gathered
// from the ranks (a collective); empty otherwise.
using MasterValues = std::unordered_map<const c10::TensorImpl*, at::Tensor>;
MasterValues gathered_masters() {
  MasterValues out;
  const auto context = detail::live_context();
  if (!context || !context->sharded()) return out;
  context->sharded()->sync();  // a torch::load into the model since the last op counts
  for (const auto& s : context->sharded()->optimizers()) {
    const std::vector<at::Tensor> whole = s->full_masters();
    for (size_t m = 0; m < whole.size(); ++m) out[s->members()[m].unsafeGetTensorImpl()] = whole[m];
  }
  return out;
}

// Data parallel: the ranks hold the same bytes, and rank 0 writes them.
// Writes `archive` to a file of the same name in a temporary folder beside
// `path`, then renames it into place: a process killed mid-write leaves the
// file that was there before (or none), never a torn one, and a reader never
// sees a partial file. (The same name: LibTorch names the archive's records
// after the file, so the bytes are a direct write's.)
void save_atomically(torch::serialize::OutputArchive& archive, const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string folder = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  const std::string partial_folder = folder + "." + name + ".partial." + std::to_string(getpid());
  TORCH_CHECK(::mkdir(partial_folder.c_str(), 0700) == 0 || errno == EEXIST, "amp: cannot create '", partial_folder,
              "' to write the checkpoint in: ", std::strerror(errno), "; the file at '", path, "', if any, is unchanged.");
  const std::string partial = partial_folder + "/" + name;
  try {
    archive.save_to(partial);
  } catch (...) {
    std::remove(partial.c_str());
    ::rmdir(partial_folder.c_str());
    throw;
  }
  const int moved = std::rename(partial.c_str(), path.c_str()) == 0 ? 0 : errno;
  std::remove(partial.c_str());
  ::rmdir(partial_folder.c_str());
  TORCH_CHECK(moved == 0, "amp: cannot move the written checkpoint into '", path, "': ", std::strerror(moved),
              "; the file there, if any, is unchanged.");
}

bool writes_files() {
  const auto context = detail::live_context();
  return !context || !context->reducer() || context->reducer()->config().group->getRank() == 0;
}

// Float32 values of a model's tensors: master weights as they are, other
// low-precision tensors widened exactly (model_weights.h).
at::Tensor fp32_value(const at::Tensor& t, const MasterValues& masters) {
  if (auto it = masters.find(t.unsafeGetTensorImpl()); it != masters.end()) return it->second;
  const auto context = detail::live_context();
  if (context) return context->weights().fp32_value(t);
  return internal::is_low_precision(t.scalar_type()) ? t.detach().to(at::kFloat) : t.detach();
}

// The dtype `optimizer` keeps its state in: where the session rounds (O6's
// weights, 8-bit state) amp's fused optimizers' kept_state_dtype; otherwise
// the parameter's own.
detail::StateDtype state_dtype(const detail::Context& context, torch::optim::Optimizer& optimizer) {
  if (context.rounding() == nullptr || detail::fused_optimizer(optimizer) == nullptr) return nullptr;
  const at::ScalarType chosen = context.properties().optimizer_state_dtype;
  return [chosen](const at::Tensor& p) { return detail::kept_state_dtype(p, chosen); };
}

torch::nn::Module& model_of(const internal::ModelRef& ref) {
  TORCH_CHECK(ref.get() != nullptr, "amp: checkpoints take the program's models; got a null one.");
  return *ref.get();
}

// torch::nn::Module::save's layout, in float32, masters in place of their
// parameters.
void write_module(const torch::nn::Module& module, torch::serialize::OutputArchive& archive,
                  const MasterValues& masters) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    archive.write(p.key(), fp32_value(p.value(), masters));
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    archive.write(b.key(), fp32_value(b.value(), masters), /*is_buffer=*/true);
  }
  for (const auto& child : module.named_children()) {
    torch::serialize::OutputArchive nested(archive.compilation_unit());
    write_module(*child.value(), nested, masters);
    archive.write(child.key(), nested);
  }
}

// Pending fused steps settled, so the state's host step counts are current.
std::vector<torch::optim::Optimizer*> settled(detail::Context& context,
                                              const std::vector<internal::OptimizerRef>& optimizers) {
  std::vector<torch::optim::Optimizer*> out;
  for (const internal::OptimizerRef& ref : optimizers) {
    TORCH_CHECK(ref.get() != nullptr, "amp: checkpoints take the program's optimizers; got a null one.");
    if (detail::OptimizerStep* step = context.step_of(*ref.get())) step->catch_up();
    out.push_back(ref.get());
  }
  return out;
}

struct PendingCopy {
  at::Tensor target;
  at::Tensor value;
};

// Reads every parameter and buffer of `module` from `archive`, checking
// presence and shape, without changing anything.
void read_module(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                 const std::string& prefix, std::vector<PendingCopy>& copies) {
  auto read = [&](const std::string& key, const at::Tensor& target, bool is_buffer) {
    at::Tensor value;
    TORCH_CHECK(archive.try_read(key, value, is_buffer), "amp: the checkpoint has no entry '",
                prefix + key, "'; it was saved from a different model.");
    TORCH_CHECK(value.sizes() == target.sizes(), "amp: checkpoint entry '", prefix + key,
                "' has shape ", value.sizes(), ", the model expects ", target.sizes());
    TORCH_CHECK(value.is_floating_point() == target.is_floating_point(), "amp: checkpoint entry '",
                prefix + key, "' holds ", value.scalar_type(), " values, the model holds ",
                target.scalar_type(), "; the checkpoint is corrupt or from another model.");
    copies.push_back({target, value});
  };
  for (const auto& p : module.named_parameters(false)) read(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(false)) read(b.key(), b.value(), true);
  for (const auto& child : module.named_children()) {
    torch::serialize::InputArchive nested;
    TORCH_CHECK(archive.try_read(child.key(), nested), "amp: the checkpoint has no submodule '",
                prefix + child.key(), "'; it was saved from a different model.");
    read_module(*child.value(), nested, prefix + child.key() + ".", copies);
  }
}

}  // namespace

void save_checkpoint(const std::string& path, const internal::ModelRefs& model_refs, const internal::OptimizerRefs& optimizer_refs) {
  auto context = detail::require_live_context("amp::save_checkpoint");
  const std::vector<internal::ModelRef>& models = model_refs.items();
  const auto optimizers = settled(*context, optimizer_refs.items());
  const MasterValues masters = gathered_masters();
  torch::serialize::OutputArchive archive;
  for (size_t i = 0; i < models.size(); ++i) {
    torch::serialize::OutputArchive model(archive.compilation_unit());
    write_module(model_of(models[i]), model, masters);
    archive.write("model" + std::to_string(i), model);
  }
  for (size_t i = 0; i < optimizers.size(); ++i) {
    torch::serialize::OutputArchive optimizer(archive.compilation_unit());
    // Sharded: the whole state, as one process writes it, to load at any world size.
    detail::ShardedOptimizer* sharded = context->sharded() ? context->sharded()->of(*optimizers[i]) : nullptr;
    sharded ? sharded->save(optimizer) : optimizers[i]->save(optimizer);
    archive.write("optimizer" + std::to_string(i), optimizer);
  }
  torch::serialize::OutputArchive amp(archive.compilation_unit());
  save_state(amp);
  archive.write("amp", amp);
  detail::write_state_format(archive);
  if (writes_files()) save_atomically(archive, path);
}

void load_checkpoint(const std::string& path, const internal::ModelRefs& model_refs, const internal::OptimizerRefs& optimizer_refs) {
  auto context = detail::require_live_context("amp::load_checkpoint");
  const std::vector<internal::ModelRef>& models = model_refs.items();
  const auto optimizers = settled(*context, optimizer_refs.items());
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "amp: cannot read checkpoint '", path, "' (missing, truncated or "
                "corrupt); nothing was loaded. Cause: ", e.what());
  }
  detail::read_state_format(archive, "checkpoint '" + path + "'");
  std::vector<PendingCopy> copies;
  for (size_t i = 0; i < models.size(); ++i) {
    torch::serialize::InputArchive model;
    TORCH_CHECK(archive.try_read("model" + std::to_string(i), model), "amp: checkpoint '", path,
                "' has no model", i, "; it holds fewer models than were passed.");
    read_module(model_of(models[i]), model, "", copies);
  }
  std::vector<torch::serialize::InputArchive> optimizer_archives(optimizers.size());
  for (size_t i = 0; i < optimizers.size(); ++i) {
    TORCH_CHECK(archive.try_read("optimizer" + std::to_string(i), optimizer_archives[i]),
                "amp: checkpoint '", path, "' has no optimizer", i, ".");
  }
  torch::serialize::InputArchive amp;
  TORCH_CHECK(archive.try_read("amp", amp), "amp: checkpoint '", path, "' has no amp state.");

  // Master weights take the values in float32, and optimizer state is
  // checked against them.
  context->weights().finish_backward();
  // Scalers and optimizers load all-or-nothing: if one part is refused, the
  // parts already loaded go back to their state before this call.
  std::vector<internal::LossScaling::State> scalers_before;
  for (int i = 0; i < context->num_losses(); ++i) scalers_before.push_back(context->scaler(i).state());
  std::vector<std::string> optimizers_before;
  for (const auto* optimizer : optimizers) optimizers_before.push_back(detail::state_bytes(*optimizer));
  size_t loaded = 0;
  try {
    load_state(amp);
    for (; loaded < optimizers.size(); ++loaded) {
      detail::ShardedOptimizer* sharded = context->sharded() ? context->sharded()->of(*optimizers[loaded]) : nullptr;
      if (sharded) {
        sharded->load(optimizer_archives[loaded]);  // this rank's part of the whole state
      } else {
        detail::load_optimizer_state(*optimizers[loaded], optimizer_archives[loaded], optimizers_before[loaded],
                                     state_dtype(*context, *optimizers[loaded]));
      }
    }
  } catch (...) {
    for (int i = 0; i < context->num_losses(); ++i) context->scaler(i).restore(scalers_before[i]);
    for (size_t i = 0; i < loaded; ++i) detail::restore_state_bytes(*optimizers[i], optimizers_before[i]);
    throw;
  }
  at::NoGradGuard no_grad;
  for (const auto& c : copies) {
    // A weight freed between uses (shard_weights) takes the values in its pieces alone.
    if (c.target.numel() == 0 || c.target.storage().nbytes() != 0) c.target.copy_(c.value);
    if (context->sharded()) context->sharded()->take_values(c.target, c.value.to(at::kFloat));
  }
}

void save_fp32_weights(internal::ModelRef model, const std::string& path) {
  torch::serialize::OutputArchive archive;
  write_module(model_of(model), archive, gathered_masters());
  if (writes_files()) save_atomically(archive, path);
}

}  // namespace amp
