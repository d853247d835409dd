#include <amp/initialize.h>

#include <amp/hardware.h>
#include <amp/model_conversion.h>

#include "context.h"
#include "log.h"

#include <c10/util/Exception.h>

#include <torch/nn/modules/embedding.h>
#include <torch/optim.h>

#include <mutex>
#include <optional>
#include <sstream>

namespace amp {
namespace {

std::mutex g_initialize_mutex;
std::vector<std::weak_ptr<torch::nn::Module>> g_converted_models;
std::vector<std::weak_ptr<torch::optim::Optimizer>> g_wrapped_optimizers;

template <class T>
bool contains(std::vector<std::weak_ptr<T>>& seen, const std::shared_ptr<T>& item) {
  bool found = false;
  for (auto it = seen.begin(); it != seen.end();) {
    if (it->expired()) {
      it = seen.erase(it);
      continue;
    }
    found = found || it->lock() == item;
    ++it;
  }
  return found;
}

// The one device every parameter and buffer lives on (CPU when there are none).
c10::Device common_device(const std::vector<ModulePtr>& models,
                          const std::vector<OptimizerPtr>& optimizers) {
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

void warn_about_dtypes(const std::vector<ModulePtr>& models, const Properties& p, int verbosity) {
  if (verbosity < 1 || !p.cast_model_type) return;
  for (const auto& model : models) {
    for (const auto& param : model->named_parameters()) {
      const c10::ScalarType t = param.value().scalar_type();
      if (!param.value().is_floating_point()) continue;
      if (*p.cast_model_type == c10::kFloat && t != c10::kFloat) {
        detail::log_line("warning: opt_level O0 expects float32 parameters, but " + param.key() + " is " +
                 c10::toString(t) + ". O0 leaves the model as it is.");
        return;
      }
      if (*p.cast_model_type != c10::kFloat && t == *p.cast_model_type) {
        detail::log_line("warning: parameter " + param.key() + " is already " + c10::toString(t) +
                 ". You do not need to convert the model before amp::initialize; masters of "
                 "already-rounded weights lose the precision O2 keeps.");
        return;
      }
    }
  }
}

// Without fp32 masters the optimizer updates low-precision parameters, and an
// epsilon that rounds to zero in their dtype turns zero gradients into 0/0
// (Adam's eps=1e-8 in float16: O3 with Adam is NaN after one step).
std::optional<double> optimizer_eps(const torch::optim::OptimizerOptions& o) {
  if (auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(&o)) return adam->eps();
  if (auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) return adamw->eps();
  if (auto* rms = dynamic_cast<const torch::optim::RMSpropOptions*>(&o)) return rms->eps();
  if (auto* adagrad = dynamic_cast<const torch::optim::AdagradOptions*>(&o)) return adagrad->eps();
  return std::nullopt;
}

void warn_about_optimizer_eps(const std::vector<OptimizerPtr>& optimizers, const Properties& p,
                              int verbosity) {
  if (verbosity < 1 || p.master_weights || !p.cast_model_type ||
      *p.cast_model_type == c10::kFloat) {
    return;
  }
  const c10::ScalarType dtype = *p.cast_model_type;
  for (const auto& optimizer : optimizers) {
    for (const auto& group : optimizer->param_groups()) {
      const std::optional<double> eps = optimizer_eps(group.options());
      if (!eps || *eps == 0 || at::scalar_tensor(*eps, dtype).item<double>() != 0) continue;
      std::ostringstream line;
      line << "warning: the optimizer's eps " << *eps << " is 0 in " << c10::toString(dtype)
           << ", the dtype it updates without fp32 master weights; expect NaN parameters. "
           << "Use master_weights (O2), or an eps representable in " << c10::toString(dtype) << ".";
      detail::log_line(line.str());
      return;
    }
  }
}

// Says once, at initialize, when the CPU will compute in a dtype it emulates.
void warn_about_cpu_precision(const Properties& p, c10::Device device, int verbosity) {
  if (verbosity < 1 || !device.is_cpu() || !p.intercepts_ops()) return;
  const std::string note = describe(cpu_precision(), p.cpu_dtype);
  if (!note.empty()) detail::log_line("note: " + note);
}

// Sparse gradients are unscaled and checked at the levels that keep the model
// fp32; the master-weight and low-precision paths are written for dense ones.
void check_no_sparse_gradients(const std::vector<ModulePtr>& models, const Properties& p) {
  if (!p.cast_model_type || *p.cast_model_type == c10::kFloat) return;
  for (const auto& model : models) {
    for (const auto& item : model->named_modules()) {
      const auto* embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(item.value().get());
      const auto* bag = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(item.value().get());
      const bool sparse = (embedding && embedding->options.sparse()) || (bag && bag->options.sparse());
      TORCH_CHECK(!sparse, "amp: module '", item.key().empty() ? model->name() : item.key(), "' (",
                  item.value()->name(), " with sparse=true) produces sparse gradients, which amp "
                  "supports at O0, O1 and O4 (the levels that keep the model float32), not at ",
                  to_string(p.opt_level), ". Use O1, or sparse=false.");
    }
  }
}

// Options::enabled = false: O0's properties (fp32, no casts, a static scale
// of 1, which never skips), marked disabled.
Properties disabled_properties(c10::Device device) {
  Properties p = resolve_properties(O0, PropertyOverrides{}, device.type());
  p.enabled = false;
  return p;
}

}  // namespace

std::vector<OptimizerPtr> Handle::initialize_models(const std::vector<ModulePtr>& models,
                                                    std::vector<OptimizerPtr> optimizers,
                                                    const Options& options) {
  std::lock_guard<std::mutex> lock(g_initialize_mutex);
  if (auto live = detail::live_context()) {
    TORCH_CHECK(false, "amp: amp is already initialized (opt_level ",
                to_string(live->properties().opt_level), "). Call amp::deinitialize() (or "
                "destroy its amp::Handle) before initializing again.");
  }
  TORCH_CHECK(options.num_losses >= 1, "amp: num_losses must be >= 1, got ", options.num_losses);
  TORCH_CHECK(options.verbosity >= 0 && options.verbosity <= 2,
              "amp: verbosity must be 0, 1 or 2, got ", options.verbosity);
  for (const auto& model : models) {
    TORCH_CHECK(model != nullptr, "amp: initialize got a null model.");
    TORCH_CHECK(model->name().find("DataParallel") == std::string::npos, "amp: the model is "
                "wrapped in ", model->name(), ". Call amp::initialize on the bare model and wrap "
                "it for data parallelism afterwards.");
    TORCH_CHECK(!contains(g_converted_models, model), "amp: this model was already converted "
                "by an earlier amp::initialize; its float32 values are gone. Pass a fresh "
                "float32 model (or load an fp32 checkpoint into it) before initializing again.");
  }
  for (const auto& optimizer : optimizers) {
    TORCH_CHECK(optimizer != nullptr, "amp: initialize got a null optimizer.");
    TORCH_CHECK(dynamic_cast<MixedPrecisionOptimizer*>(optimizer.get()) == nullptr &&
                    !contains(g_wrapped_optimizers, optimizer),
                "amp: this optimizer was already passed through amp::initialize. Create a new "
                "optimizer for a new initialization.");
  }
  const c10::Device device = common_device(models, optimizers);
  const Properties requested = resolve_properties(options.opt_level, options, device.type());
  const Properties properties = options.enabled ? requested : disabled_properties(device);
  check_no_sparse_gradients(models, properties);
  if (options.enabled) {
    warn_about_dtypes(models, properties, options.verbosity);
    warn_about_optimizer_eps(optimizers, properties, options.verbosity);
    warn_about_cpu_precision(properties, device, options.verbosity);
  }

  // Everything is validated; from here on amp changes state.
  std::vector<std::pair<at::Tensor, at::Tensor>> fp32_originals;
  const bool convert = properties.cast_model_type && *properties.cast_model_type != c10::kFloat;
  for (const auto& model : models) {
    if (!convert) continue;
    for (auto& c : convert_model(*model, *properties.cast_model_type,
                                 properties.keep_batchnorm_fp32, options.keep_fp32)) {
      fp32_originals.emplace_back(c.parameter, c.fp32_original);
    }
    g_converted_models.push_back(model);
  }
  auto context = detail::start_live_context(properties, options);
  context_ = context;
  std::vector<OptimizerPtr> wrapped;
  for (auto& optimizer : optimizers) {
    g_wrapped_optimizers.push_back(optimizer);
    wrapped.push_back(std::make_shared<MixedPrecisionOptimizer>(
        optimizer, properties.master_weights, fp32_originals, context, options.fused_step));
  }
  if (options.verbosity >= 1) std::cerr << describe(properties);
  return wrapped;
}

Handle::~Handle() {
  try {
    deinitialize();
  } catch (const std::exception& e) {
    detail::log_line(std::string("error: deinitializing amp failed: ") + e.what());
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

Handle& global_handle() {
  static Handle* handle = new Handle();  // never destroyed: no teardown during static exit
  return *handle;
}

void deinitialize() {
  std::lock_guard<std::mutex> lock(g_initialize_mutex);
  const auto live = detail::require_live_context("amp::deinitialize");
  TORCH_CHECK(global_handle().active(), "amp: amp::deinitialize() ends the initialization made by "
              "amp::initialize, but the live one is owned by an amp::Handle. End it with "
              "handle.deinitialize(), or let the handle go out of scope.");
  detail::end_live_context(live);
}

bool is_initialized() { return detail::live_context() != nullptr; }

Properties properties() { return detail::require_live_context("amp::properties")->properties(); }

LossScaler& loss_scaler(int loss_id) {
  return detail::require_live_context("amp::loss_scaler")->scaler(loss_id);
}

double loss_scale(int loss_id) {
  return detail::require_live_context("amp::loss_scale")->scaler(loss_id).scale();
}

}  // namespace amp
