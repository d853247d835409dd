// SPDX-License-Identifier: BSD-3-Clause
#include <cmath>
#include <amp/initialize.h>
#include <amp/internal/level_rules.h>

#include <amp/hardware.h>
#include <amp/model_conversion.h>
#include <amp/telemetry.h>

#include "session/context.h"
#include "fp8/fp8_linear.h"
#include "distributed/replicas.h"
#include "support/cpu_heap.h"
#include "support/log.h"
#include "support/versions.h"
#include "model/module_walk.h"
#include "optim/optimizer_kinds.h"
#include "distributed/sharded_optimizer.h"

#include <c10/util/Exception.h>

#include <ATen/EmptyTensor.h>
#include <torch/nn/modules/embedding.h>
#include <torch/optim/sgd.h>

#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_set>

namespace amp {
namespace {

std::mutex g_initialize_mutex;

using Modules = std::vector<torch::nn::Module*>;
using Optimizers = std::vector<torch::optim::Optimizer*>;

// The one device every parameter and buffer lives on (CPU when there are none).
c10::Device common_device(const Modules& models, const Optimizers& optimizers) {
  std::optional<c10::Device> device;
  auto visit = [&](const at::Tensor& t, const std::string& where) {
    if (!device) device = t.device();
    TORCH_CHECK(t.device() == *device, "amp: parameters and buffers must all live on one "
                "device, but ", where, " is on ", t.device(), " and others on ", *device,
                ". Move the model with model->to(device) before amp::initialize.");
  };
  for (const auto& model : models) {
    for (const auto& p : model->named_parameters()) visit(p.value(), "parameter " + p.key());
    for (const auto& b : model->named_buffers()) visit(b.value(), "buffer " + b.key());
  }
  for (const auto& optimizer : optimizers) {
    for (const auto& group : optimizer->param_groups()) {
      for (const auto& p : group.params()) visit(p, "an optimizer parameter");
    }
  }
  return device.value_or(c10::Device(c10::kCPU));
}

void warn_about_dtypes(const Modules& models, const Properties& p, int verbosity) {
  if (verbosity < 1 || !p.cast_model_type) return;
  for (const auto& model : models) {
    for (const auto& param : model->named_parameters()) {
      const c10::ScalarType t = param.value().scalar_type();
      if (!param.value().is_floating_point()) continue;
      if (*p.cast_model_type == c10::kFloat && t != c10::kFloat) {
        detail::warn("model_not_float32_at_o0", "opt_level O0 expects float32 parameters, but " +
                     param.key() + " is " + c10::toString(t) + ". O0 leaves the model as it is.");
        return;
      }
      if (*p.cast_model_type != c10::kFloat && t == *p.cast_model_type) {
        detail::warn("model_already_low_precision",
                     "parameter " + param.key() + " is already " + c10::toString(t) +
                         ". You do not need to convert the model before amp::initialize; masters "
                         "of already-rounded weights lose the precision O2 keeps.");
        return;
      }
    }
  }
}

// Without fp32 masters the optimizer updates low-precision parameters in
// their dtype, its state too. An epsilon that rounds to zero there turns zero
// gradients into 0/0 (Adam's eps=1e-8 in float16: NaN after one step). In
// float16 squared gradients flush to zero besides ((1 - beta2) * g^2 below
// 6e-8: |g| < 7.7e-3 for beta2 = 0.999), and those elements step by
// lr * m / eps: O3 with Adam diverges, as pure-float16 Adam does in PyTorch.
// bfloat16 has float32's range, and neither happens.
void warn_about_optimizer_eps(const Optimizers& optimizers, const Properties& p, int verbosity) {
  if (verbosity < 1 || p.master_weights || !p.cast_model_type ||
      *p.cast_model_type == c10::kFloat) {
    return;
  }
  const c10::ScalarType dtype = *p.cast_model_type;
  for (const auto& optimizer : optimizers) {
    for (const auto& group : optimizer->param_groups()) {
      const std::optional<double> eps = detail::optimizer_eps(group.options());
      if (!eps) continue;
      const std::string name = c10::toString(dtype);
      std::ostringstream line;
      if (*eps != 0 && at::scalar_tensor(*eps, dtype).item<double>() == 0) {
        line << "the optimizer's eps " << *eps << " is 0 in " << name
             << ", the dtype it updates without fp32 master weights; expect NaN parameters. "
             << "Use master_weights (O2), or bfloat16 (cuda_dtype/cpu_dtype).";
        detail::warn("optimizer_eps_vanishes", line.str());
        return;
      }
      if (dtype == c10::kHalf) {
        line << "the optimizer keeps squared gradients in " << name
             << " without fp32 master weights: below " << name << "'s smallest value (6e-8) they are 0, and "
             << "those elements step by lr * m / eps; expect training to diverge. Use master_weights (O2), or "
             << "bfloat16 (cuda_dtype/cpu_dtype, or O6).";
        detail::warn("optimizer_moments_underflow", line.str());
        return;
      }
    }
  }
}

// Says once, at initialize, when the CPU will compute in a dtype it emulates.
// float8 on a device without float8 GEMMs (the CPU) is emulated: said once,
// here, not at every GEMM.
void note_fp8_emulation(const Properties& p, c10::Device device, int verbosity) {
  if (verbosity < 1 || !p.fp8 || device.is_cuda()) return;
  detail::emit({LogEvent::Kind::kNote, "fp8_emulated", "fp8 on " + device.str() + ": " +
                fp8_quantization_path(device) + ". Use it to check a float8 run's numbers; a CUDA device of "
                "compute capability 8.9 or newer runs float8 GEMMs."});
}

void warn_about_cpu_precision(const Properties& p, c10::Device device, int verbosity) {
  if (verbosity < 1 || !device.is_cpu() || !p.intercepts_ops()) return;
  const std::string note = describe(cpu_precision(), p.cpu_dtype);
  if (!note.empty()) detail::emit({LogEvent::Kind::kNote, "cpu_emulates_dtype", note});
}

// The first module producing sparse gradients (Embedding or EmbeddingBag
// with sparse=true), with its name; null when there is none.
std::pair<const torch::nn::Module*, std::string> sparse_gradient_module(const Modules& models) {
  std::pair<const torch::nn::Module*, std::string> found{nullptr, ""};
  for (const auto& model : models) {
    detail::for_each_module(*model, [&](const std::string& name, torch::nn::Module& module) {
      const auto* embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(&module);
      const auto* bag = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(&module);
      const bool sparse = (embedding && embedding->options.sparse()) || (bag && bag->options.sparse());
      if (sparse && !found.first) found = {&module, name.empty() ? model->name() : name};
    });
  }
  return found;
}

// Sparse gradients are unscaled and checked at the levels that keep the model
// fp32; the master-weight and low-precision paths are written for dense ones.
void check_no_sparse_gradients(const Modules& models, const Properties& p) {
  if (!p.cast_model_type || *p.cast_model_type == c10::kFloat) return;
  const auto [module, name] = sparse_gradient_module(models);
  TORCH_CHECK(module == nullptr, "amp: module '", name, "' (", module->name(), " with sparse=true) "
              "produces sparse gradients, which amp supports at O0, O1 and O4 (the levels that "
              "keep the model float32), not at ", to_string(p.opt_level), ". Use O1, or sparse=false.");
}

// Options::data_parallel.shard: what sharding needs of the level and the
// optimizers.
void check_sharding(const Options& o, const Properties& p, const Optimizers& optimizers) {
  const DataParallel& dp = o.data_parallel;
  TORCH_CHECK(dp.shard || !dp.shard_weights, "amp: Options::data_parallel.shard_weights spreads the weights "
              "as well as what shard spreads (ZeRO stage 3); set shard = true too.");
  if (!dp.shard) return;
  TORCH_CHECK(dp.group, "amp: Options::data_parallel.shard needs data_parallel.group, the ranks' "
              "process group, to spread the float32 masters and optimizer state over.");
  TORCH_CHECK((p.master_weights || p.stochastic_rounding) && p.cast_model_type && *p.cast_model_type != c10::kFloat,
              "amp: Options::data_parallel.shard spreads what the optimizer steps and its state "
              "over the ranks: the float32 master weights of O2 and O5, or O6's bfloat16 weights; "
              "opt_level ", to_string(p.opt_level), " steps the model's own weights, which every "
              "rank holds whole. Use O2, O5 or O6, or shard=false.");
  TORCH_CHECK(!optimizers.empty(), "amp: Options::data_parallel.shard needs the optimizers whose "
              "state it spreads; pass them to amp::initialize.");
  std::unordered_set<const c10::TensorImpl*> seen;
  for (torch::optim::Optimizer* optimizer : optimizers) {
    for (const auto& group : optimizer->param_groups()) {
      TORCH_CHECK(detail::make_state(group.options(), {}, 0) != nullptr, "amp: "
                  "Options::data_parallel.shard shards the state of SGD, Adam, AdamW, Adagrad and "
                  "RMSprop (and amp's fused ones), which update each element on its own; this "
                  "optimizer is none of them. Use one of them, or shard=false.");
      for (const at::Tensor& param : group.params()) {
        TORCH_CHECK(seen.insert(param.unsafeGetTensorImpl()).second, "amp: a parameter is in two "
                    "parameter groups or optimizers; with Options::data_parallel.shard each "
                    "parameter's master lives in one optimizer's shard. Give each parameter to one.");
        TORCH_CHECK(!dp.shard_weights || (param.storage_offset() == 0 && param.is_contiguous() &&
                                          param.storage().use_count() == 1 &&
                                          param.storage().nbytes() == param.nbytes()),
                    "amp: Options::data_parallel.shard_weights frees each parameter's bytes between uses, "
                    "but a parameter of shape ", param.sizes(), " shares its storage with another tensor "
                    "(a view of a flat buffer, or a tensor made with from_blob): freeing it would free the "
                    "other. Give each parameter storage of its own (param.clone()), or shard_weights=false.");
      }
    }
    // LibTorch's Adagrad makes a fresh state (step 0) when constructed.
    const bool fresh = std::all_of(optimizer->state().begin(), optimizer->state().end(), [](const auto& entry) {
      const auto* adagrad = dynamic_cast<const torch::optim::AdagradParamState*>(entry.second.get());
      return adagrad != nullptr && adagrad->step() == 0;
    });
    TORCH_CHECK(fresh, "amp: an optimizer already holds state (loaded or "
                "stepped before amp::initialize). With Options::data_parallel.shard, initialize "
                "first, then load with amp::load_checkpoint, which splits the whole state over "
                "the ranks.");
  }
}

// Stochastic rounding (O6) happens in amp's fused optimizers; LibTorch's
// own would round every update to nearest, and small ones would vanish.
// 8-bit state is packed and unpacked by amp's fused optimizers alone.
void check_rounding_optimizers(const Optimizers& optimizers, const Properties& p) {
  if (p.optimizer_state_dtype == at::kByte) {
    for (torch::optim::Optimizer* optimizer : optimizers) {
      TORCH_CHECK(detail::fused_optimizer(*optimizer) != nullptr, "amp: optimizer_state_dtype uint8 keeps the "
                  "optimizer's state in 8 bits, which amp's fused optimizers step; this optimizer is LibTorch's "
                  "own, whose step reads float state. Use amp::optim::FusedAdamW, FusedAdam or FusedSGD (same "
                  "options), or leave optimizer_state_dtype unset.");
    }
  }
  if (!p.stochastic_rounding) return;
  for (torch::optim::Optimizer* optimizer : optimizers) {
    TORCH_CHECK(detail::fused_optimizer(*optimizer) != nullptr, "amp: opt_level ", to_string(p.opt_level),
                " rounds each update into the bfloat16 weights stochastically, which amp's fused "
                "optimizers do; this optimizer is LibTorch's own, whose bfloat16 updates round to "
                "nearest and lose every change below half a bf16 ulp. Use amp::optim::FusedAdamW, "
                "FusedAdam or FusedSGD (same options), or stochastic_rounding=false.");
  }
}

// Properties::step_in_backward: amp's fused optimizers apply each update as
// its gradient becomes final, on this rank, and nothing reads the gradients
// afterwards.
void check_step_in_backward(const Options& o, const Properties& p, const Optimizers& optimizers, c10::Device device) {
  if (!p.step_in_backward) return;
  const bool low_precision_steps = p.cast_model_type && *p.cast_model_type != at::kFloat && !p.master_weights &&
                                   !p.stochastic_rounding;  // O3
  for (torch::optim::Optimizer* optimizer : optimizers) {
    TORCH_CHECK(!(low_precision_steps && device.is_cpu() && dynamic_cast<torch::optim::SGD*>(optimizer) != nullptr),
                "amp: step_in_backward steps each parameter with amp's fused kernels, but ATen's CPU SGD kernel "
                "does not step ", *p.cast_model_type, " parameters, which ", to_string(p.opt_level), " leaves "
                "to LibTorch's step after backward. Use FusedAdamW or FusedAdam, or O6 (bfloat16 weights stepped "
                "in float32).");
  }
  TORCH_CHECK(!optimizers.empty(), "amp: step_in_backward applies the optimizers' updates during backward; pass "
              "them to amp::initialize(model, optimizer, options).");
  for (torch::optim::Optimizer* optimizer : optimizers) {
    TORCH_CHECK(detail::fused_optimizer(*optimizer) != nullptr, "amp: step_in_backward applies each update "
                "during backward with amp's fused kernels, one parameter at a time; this optimizer is LibTorch's "
                "own, whose step() takes all parameters at once. Use amp::optim::FusedAdamW, FusedAdam or FusedSGD "
                "(same options).");
  }
  TORCH_CHECK((!o.data_parallel.group || o.data_parallel.shard) && !o.reduce_overflow, "amp: step_in_backward "
              "applies each update as soon as its gradient is final, but with replicated data_parallel (or "
              "reduce_overflow) a gradient is final only once every rank's backward has reached it, and amp "
              "averages whole gradients after backward. Set data_parallel.shard (ZeRO-2, or ZeRO-3 with "
              "shard_weights: each rank steps its pieces as their bucket is reduced), or leave step_in_backward "
              "unset.");
  TORCH_CHECK(!o.precision_telemetry && !o.overflow_provenance, "amp: precision_telemetry and "
              "overflow_provenance read the gradients after backward, which step_in_backward frees as it applies "
              "them. Turn those options off, or step_in_backward.");
}

// Options::data_parallel, checked before any collective runs.
void check_data_parallel(const Options& o, const Modules& models) {
  const DataParallel& dp = o.data_parallel;
  if (!dp.group) return;
  TORCH_CHECK(!o.reduce_overflow, "amp: both Options::data_parallel.group and "
              "Options::reduce_overflow are set. With data_parallel amp averages the gradients "
              "and agrees every overflow itself: drop reduce_overflow and your own gradient "
              "all-reduce.");
  TORCH_CHECK(dp.reduce_dtype == c10::kFloat || dp.reduce_dtype == c10::kHalf ||
                  dp.reduce_dtype == c10::kBFloat16,
              "amp: Options::data_parallel.reduce_dtype must be float32, float16 or bfloat16, got ",
              dp.reduce_dtype, ".");
  TORCH_CHECK(dp.bucket_bytes >= 1, "amp: Options::data_parallel.bucket_bytes must be >= 1, got ",
              dp.bucket_bytes, " (DDP's default is 25 MiB).");
  TORCH_CHECK(dp.gather_timeout.count() >= 1, "amp: Options::data_parallel.gather_timeout must be at "
              "least 1 ms, got ", dp.gather_timeout.count(), " ms.");
  const auto [module, name] = sparse_gradient_module(models);
  TORCH_CHECK(module == nullptr, "amp: module '", name, "' (", module->name(), " with sparse=true) "
              "produces sparse gradients, which Options::data_parallel cannot average in "
              "buckets. Use sparse=false.");
}

// Options::fp8_scaling, checked whatever the level (a typo stays visible).
void check_fp8_scaling(const Options::Fp8Scaling& f) {
  TORCH_CHECK(f.amax_history_len >= 1, "amp: Options::fp8_scaling.amax_history_len must be at least 1, got ",
              f.amax_history_len, " (Transformer Engine's default is 1024; amp's 16).");
  TORCH_CHECK(f.margin >= 0, "amp: Options::fp8_scaling.margin must be >= 0, got ", f.margin, ".");
  TORCH_CHECK(!f.min_gemm_intensity || (std::isfinite(*f.min_gemm_intensity) && *f.min_gemm_intensity >= 0),
              "amp: Options::fp8_scaling.min_gemm_intensity must be a finite number >= 0, got ",
              f.min_gemm_intensity.value_or(0), " (0 runs every qualifying GEMM in float8; leave it unset for the "
              "calibrated default).");
}

// The fp8 property on a device without float8 GEMMs fails here, not in
// the first forward.
void check_fp8_kernels(c10::Device device) {
  const std::string missing = detail::float8_unavailable(device);
  TORCH_CHECK(missing.empty(), "amp: fp8 needs float8 GEMM kernels on ", device, " (CUDA compute capability 8.9 "
              "or newer: Ada, Hopper), which this device lacks: ", missing, " Use O5 without fp8 here.");
}

// Options::enabled = false: O0's properties (fp32, no casts, a static scale
// of 1, which never skips), marked disabled.
Properties disabled_properties(c10::Device device) {
  Properties p = internal::resolve_properties(O0, PropertyOverrides{}, device.type());
  p.enabled = false;
  return p;
}


// A tensor whose storage holds another dtype's bytes: LibTorch's
// InputArchive copies a checkpoint's bytes into a tensor of another dtype
// without converting them (a float32 checkpoint loaded into a float16 model).
void check_storages(const Modules& models) {
  for (const torch::nn::Module* model : models) {
    auto check = [](const std::string& name, const at::Tensor& t) {
      if (!t.defined() || t.numel() == 0 || t.element_size() != 2 || !t.is_floating_point()) return;
      const size_t as_fp32 = at::detail::computeStorageNbytes(t.sizes(), t.strides(), 4, t.storage_offset());
      TORCH_CHECK(t.storage().nbytes() < as_fp32, "amp: '", name,
                  "' is ", t.scalar_type(), " but its storage holds ", t.storage().nbytes(),
                  " bytes, as many as float32 values take: a torch::load of a float32 "
                  "checkpoint into the ", t.scalar_type(), " model, whose bytes LibTorch does "
                  "not convert. Load float32 checkpoints into the float32 model, before "
                  "converting it (or let amp::initialize convert it).");
    };
    for (const auto& p : model->named_parameters()) check(p.key(), p.value());
    for (const auto& b : model->named_buffers()) check(b.key(), b.value());
  }
}

// The models' lowered weights for the level: converted now for good, or
// float32 masters amp lowers for forward and backward.
// The level's lowered tensors of every model.
std::unordered_set<const c10::TensorImpl*> lowered_set(const Modules& models, const Properties& p,
                                                       const Options& options) {
  std::unordered_set<const c10::TensorImpl*> lowered;
  for (torch::nn::Module* model : models) {
    for (const LoweredTensor& t : lowered_tensors(*model, p.keep_batchnorm_fp32, options.keep_fp32)) {
      lowered.insert(t.tensor.unsafeGetTensorImpl());
    }
  }
  return lowered;
}

// The float32 masters and optimizer state spread over the ranks
// (data_parallel.shard); taken before the weights are lowered. Pieces are
// named after their parameter for overflow reports.
std::unique_ptr<detail::ShardedMasters> shard_masters(const Modules& models, const Optimizers& optimizers,
                                                      const Properties& p, const Options& options,
                                                      detail::ParameterNames& names) {
  if (!options.data_parallel.shard) return nullptr;
  const auto lowered = lowered_set(models, p, options);
  const c10::ScalarType low = *p.cast_model_type;
  detail::ShardDtypes dtypes;
  dtypes.compute = [&](const at::Tensor& t) { return lowered.count(t.unsafeGetTensorImpl()) ? low : t.scalar_type(); };
  dtypes.masters = p.master_weights;
  dtypes.rounded_state = p.optimizer_state_dtype;
  auto sharded = std::make_unique<detail::ShardedMasters>(optimizers, options.data_parallel, dtypes);
  for (const auto& s : sharded->optimizers()) {
    for (const detail::ReduceBucket& bucket : s->buckets()) {
      for (const detail::ReduceBucket::Piece& piece : bucket.pieces) {
        auto it = names.find(bucket.members[piece.member].unsafeGetTensorImpl());
        if (it == names.end()) continue;
        names.emplace(piece.stepped.unsafeGetTensorImpl(),
                      it->second + "[" + std::to_string(piece.begin) + ":" +
                          std::to_string(piece.begin + piece.length) + "]");
      }
    }
  }
  return sharded;
}

std::unique_ptr<detail::ModelWeights> lower_weights(const Modules& models, bool any_optimizer,
                                                    const Properties& p, const Options& options) {
  using Mode = detail::ModelWeights::Mode;
  if (!p.cast_model_type || *p.cast_model_type == c10::kFloat) {
    return std::make_unique<detail::ModelWeights>();
  }
  const c10::ScalarType low = *p.cast_model_type;
  // Sharded masters live in the optimizers' pieces: the model is converted.
  const bool masters = p.master_weights && any_optimizer && !options.data_parallel.shard;
  const Mode mode = masters ? Mode::kMasters : Mode::kConverted;
  std::vector<detail::ModelWeights::Entry> entries;
  std::unordered_set<const c10::TensorImpl*> seen;  // tensors shared by two models: once
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < models.size(); ++i) {
    const std::string prefix = models.size() > 1 ? "model" + std::to_string(i) + "." : "";
    for (LoweredTensor& t : lowered_tensors(*models[i], p.keep_batchnorm_fp32, options.keep_fp32)) {
      if (!seen.insert(t.tensor.unsafeGetTensorImpl()).second) continue;
      const c10::ScalarType target = mode == Mode::kMasters ? c10::kFloat : low;
      if (t.tensor.scalar_type() != target) t.tensor.set_data(t.tensor.variable_data().to(target));
      detail::ModelWeights::Entry entry;
      entry.name = prefix + t.name;
      entry.tensor = t.tensor;
      entry.model = i;
      entry.is_buffer = t.is_buffer;
      entry.low = low;
      entries.push_back(std::move(entry));
    }
  }
  return std::make_unique<detail::ModelWeights>(mode, std::move(entries), models.size());
}

// Names for overflow reports, as amp's checkpoints name parameters:
// "model<i>." before each when there are several models.
std::shared_ptr<detail::ParameterNames> parameter_names(const Modules& models) {
  auto names = std::make_shared<detail::ParameterNames>();
  for (size_t i = 0; i < models.size(); ++i) {
    const std::string prefix = models.size() > 1 ? "model" + std::to_string(i) + "." : "";
    for (const auto& item : models[i]->named_parameters()) {
      names->emplace(item.value().unsafeGetTensorImpl(), prefix + item.key());
    }
  }
  return names;
}

// The models' buffers, named as parameter_names names parameters.
detail::NamedBuffers model_buffers(const Modules& models) {
  detail::NamedBuffers buffers;
  for (size_t i = 0; i < models.size(); ++i) {
    const std::string prefix = models.size() > 1 ? "model" + std::to_string(i) + "." : "";
    for (const auto& item : models[i]->named_buffers()) buffers.emplace_back(prefix + item.key(), item.value());
  }
  return buffers;
}

}  // namespace

void Handle::initialize_refs(const std::vector<internal::ModelRef>& model_refs,
                             const std::vector<internal::OptimizerRef>& optimizer_refs,
                             const Options& options) {
  std::lock_guard<std::mutex> lock(g_initialize_mutex);
  detail::require_linked_torch();
  if (auto live = detail::live_context()) {
    TORCH_CHECK(false, "amp: amp is already initialized (opt_level ",
                to_string(live->properties().opt_level), "). Call amp::deinitialize() (or "
                "destroy its amp::Handle) before initializing again.");
  }
  TORCH_CHECK(options.num_losses >= 1, "amp: num_losses must be >= 1, got ", options.num_losses);
  TORCH_CHECK(options.verbosity >= 0 && options.verbosity <= 2,
              "amp: verbosity must be 0, 1 or 2, got ", options.verbosity);
  Modules models;
  for (const internal::ModelRef& ref : model_refs) {
    torch::nn::Module* model = ref.get();
    TORCH_CHECK(model != nullptr, "amp: initialize got a null model.");
    TORCH_CHECK(model->name().find("DataParallel") == std::string::npos, "amp: the model is "
                "wrapped in ", model->name(), ". Call amp::initialize on the bare model and wrap "
                "it for data parallelism afterwards.");
    models.push_back(model);
  }
  Optimizers optimizers;
  for (const internal::OptimizerRef& ref : optimizer_refs) {
    torch::optim::Optimizer* optimizer = ref.get();
    TORCH_CHECK(optimizer != nullptr, "amp: initialize got a null optimizer.");
    TORCH_CHECK(std::find(optimizers.begin(), optimizers.end(), optimizer) == optimizers.end(),
                "amp: initialize got the same optimizer twice.");
    optimizers.push_back(optimizer);
  }
  const c10::Device device = common_device(models, optimizers);
  const Properties requested = internal::resolve_properties(options.opt_level, options, device.type());
  const Properties properties = options.enabled ? requested : disabled_properties(device);
  check_no_sparse_gradients(models, properties);
  check_data_parallel(options, models);
  check_fp8_scaling(options.fp8_scaling);
  TORCH_CHECK(!options.measured_policy_timer || options.measured_policy, "amp: Options::measured_policy_timer "
              "is set but measured_policy is false, so nothing would be timed. Set measured_policy = true, or "
              "leave the timer unset.");
  if (properties.fp8) check_fp8_kernels(device);
  if (options.enabled) check_sharding(options, properties, optimizers);
  check_rounding_optimizers(optimizers, properties);
  check_step_in_backward(options, properties, optimizers, device);
  check_storages(models);
  if (options.enabled) {
    warn_about_dtypes(models, properties, options.verbosity);
    warn_about_optimizer_eps(optimizers, properties, options.verbosity);
    warn_about_cpu_precision(properties, device, options.verbosity);
    note_fp8_emulation(properties, device, options.verbosity);
  }

  // Everything is validated; from here on amp changes state.
  if (device.is_cpu() && options.keep_cpu_memory && detail::keep_cpu_memory() && options.verbosity >= 1) {
    detail::emit({LogEvent::Kind::kNote, "keeps_cpu_memory",
                  "malloc now keeps the CPU memory a step frees for the next step (Options::keep_cpu_memory): "
                  "the process holds up to its peak heap, for every thread, after deinitialize too. "
                  "keep_cpu_memory=false leaves malloc as it was; malloc_trim(0) gives the memory back."});
  }
  if (options.data_parallel.group) detail::broadcast_from_rank0(models, *options.data_parallel.group);
  auto names = parameter_names(models);
  Options effective = options;
  effective.data_parallel.shard = options.data_parallel.shard && options.enabled;
  auto sharded = shard_masters(models, optimizers, properties, effective, *names);
  auto weights = lower_weights(models, !optimizers.empty(), properties, effective);
  context_ = detail::start_live_context(properties, effective, std::move(weights), optimizers,
                                        std::move(names), std::move(sharded), model_buffers(models));
  if (options.verbosity >= 1) detail::emit({LogEvent::Kind::kProperties, "", describe(properties)});
}

Handle::~Handle() {
  try {
    deinitialize();
  } catch (const std::exception& e) {
    detail::log_error(std::string("deinitializing amp failed: ") + e.what());
  }
}

void Handle::deinitialize() {
  std::lock_guard<std::mutex> lock(g_initialize_mutex);
  if (active()) detail::end_live_context(context_);
  context_.reset();
}

bool Handle::active() const {
  return context_ != nullptr && detail::live_context() == context_;
}

Handle& internal::global_handle() {
  static Handle* handle = new Handle();  // never destroyed: no teardown during static exit
  return *handle;
}

void deinitialize() {
  std::lock_guard<std::mutex> lock(g_initialize_mutex);
  const auto live = detail::require_live_context("amp::deinitialize");
  TORCH_CHECK(internal::global_handle().active(), "amp: amp::deinitialize() ends the initialization made by "
              "amp::initialize, but the live one is owned by an amp::Handle. End it with "
              "handle.deinitialize(), or let the handle go out of scope.");
  detail::end_live_context(live);
}

bool is_initialized() { return detail::live_context() != nullptr; }

Properties properties() { return detail::require_live_context("amp::properties")->properties(); }

std::shared_ptr<LossScaler> loss_scaler(int loss_id) {
  return detail::require_live_context("amp::loss_scaler")->shared_scaler(loss_id);
}

internal::LossScaling& internal::live_scaling(int loss_id) {
  return *detail::require_live_context("amp::internal::live_scaling")->shared_scaler(loss_id);
}

}  // namespace amp
