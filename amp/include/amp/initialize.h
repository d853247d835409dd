// amp::initialize: the front door (Apex's amp.initialize).
//
//   std::shared_ptr<torch::optim::Optimizer> optimizer =
//       std::make_shared<torch::optim::Adam>(model->parameters(), 1e-3);
//   std::tie(model, optimizer) = amp::initialize(model, optimizer, amp::O2);
//
// Converts the model(s) per the opt level (O2/O3: low precision with fp32
// affine BatchNorm at O2), starts amp's dispatcher interception (O1-O5), and
// returns each optimizer wrapped as a MixedPrecisionOptimizer (master
// weights at O2, skipped steps after overflows). Models are converted in place
// and returned as given (a std::shared_ptr<Net> or a ModuleHolder); hold the
// optimizer as std::shared_ptr<torch::optim::Optimizer> to assign the result.
// Without optimizers (inference) only the model side applies.
//
// amp stays active until amp::deinitialize() - or, for an initialization
// made through a Handle, until handle.deinitialize() or the handle's
// destruction - which removes every dispatcher registration and thread-state
// change amp made: LibTorch (native at::autocast included) behaves exactly as
// before. Call it on the thread that called initialize, once no other thread
// uses amp's casting. At most one initialization is live at a time.
//
// Errors (c10::Error; nothing is changed when initialize throws):
//   - amp is already initialized (deinitialize first);
//   - an invalid opt level or override (see opt_levels.h), num_losses < 1,
//     verbosity outside 0..2;
//   - a null model or optimizer; an optimizer already returned by (or passed
//     to) initialize;
//   - a model wrapped in a data-parallel wrapper (wrap after initialize);
//   - a model already converted by amp;
//   - parameters on more than one device;
//   - at O2/O3/O5, an Embedding or EmbeddingBag with sparse=true (sparse
//     gradients are supported at O0, O1 and O4).
// Warnings (stderr, verbosity >= 1): a model that is already low precision
// when initialize converts it, or not float32 at O0; an optimizer (Adam,
// AdamW, RMSprop, Adagrad) whose eps is 0 in the dtype it would update
// without master weights (O3 float16 with eps=1e-8: NaN after one step).
#pragma once

#include <amp/loss_scaler.h>
#include <amp/options.h>
#include <amp/optimizer.h>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <utility>
#include <vector>

namespace amp {

namespace detail {
class Context;

inline std::shared_ptr<torch::nn::Module> as_module(std::shared_ptr<torch::nn::Module> m) {
  return m;
}
template <class T>
std::shared_ptr<torch::nn::Module> as_module(const std::shared_ptr<T>& m) {
  return m;
}
template <class T>
std::shared_ptr<torch::nn::Module> as_module(const torch::nn::ModuleHolder<T>& m) {
  return m.ptr();
}
}  // namespace detail

using OptimizerPtr = std::shared_ptr<torch::optim::Optimizer>;
using ModulePtr = std::shared_ptr<torch::nn::Module>;

// Owns one initialization of amp, for code that wants it scoped:
//
//   {
//     amp::Handle handle;
//     std::tie(model, optimizer) = handle.initialize(model, optimizer, amp::O2);
//     ...                                   // amp is live
//   }                                       // ended here, LibTorch as before
//
// Only its handle ends it: amp::deinitialize() refuses (see below), so code
// elsewhere cannot end a scope's mixed precision under it. The free
// amp::initialize() uses a process-wide handle (global_handle()).
class Handle {
 public:
  Handle() = default;
  ~Handle();
  Handle(Handle&&) noexcept = default;
  Handle& operator=(Handle&&) = delete;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  template <class Model>
  std::pair<Model, OptimizerPtr> initialize(Model model, OptimizerPtr optimizer,
                                            const Options& options = {}) {
    auto optimizers = initialize_models({detail::as_module(model)}, {std::move(optimizer)}, options);
    return {std::move(model), std::move(optimizers.front())};
  }

  template <class Model>
  Model initialize(Model model, const Options& options) {
    initialize_models({detail::as_module(model)}, {}, options);
    return model;
  }

  std::pair<std::vector<ModulePtr>, std::vector<OptimizerPtr>> initialize(
      std::vector<ModulePtr> models, std::vector<OptimizerPtr> optimizers,
      const Options& options = {}) {
    auto wrapped = initialize_models(models, std::move(optimizers), options);
    return {std::move(models), std::move(wrapped)};
  }

  // Ends this handle's initialization if it is still live; a no-op
  // otherwise. Errors: as amp::deinitialize(), except that it ends a
  // handle's initialization.
  void deinitialize();
  // Whether this handle's initialization is the live one.
  bool active() const;

 private:
  std::vector<OptimizerPtr> initialize_models(const std::vector<ModulePtr>& models,
                                              std::vector<OptimizerPtr> optimizers,
                                              const Options& options);

  std::shared_ptr<detail::Context> context_;
};

// The process-wide handle behind the free functions below (never destroyed).
Handle& global_handle();

template <class Model>
std::pair<Model, OptimizerPtr> initialize(Model model, OptimizerPtr optimizer,
                                          const Options& options = {}) {
  return global_handle().initialize(std::move(model), std::move(optimizer), options);
}

template <class Model>
Model initialize(Model model, const Options& options) {
  return global_handle().initialize(std::move(model), options);
}

inline std::pair<std::vector<ModulePtr>, std::vector<OptimizerPtr>> initialize(
    std::vector<ModulePtr> models, std::vector<OptimizerPtr> optimizers,
    const Options& options = {}) {
  return global_handle().initialize(std::move(models), std::move(optimizers), options);
}

// Ends the initialization made by amp::initialize. Errors (nothing changes):
// amp is not initialized; the live initialization belongs to an amp::Handle
// (end it with handle.deinitialize() or by destroying the handle); called
// from another thread than initialize; enable_casts scopes still alive on
// other threads.
void deinitialize();
bool is_initialized();

// The live initialization's resolved properties. Errors: not initialized.
Properties properties();

// The current scale of loss `loss_id` (reads the device). Errors: not
// initialized, loss_id out of range.
double loss_scale(int loss_id = 0);

// The live initialization's scaler for `loss_id` (tests, advanced use).
LossScaler& loss_scaler(int loss_id = 0);

}  // namespace amp
