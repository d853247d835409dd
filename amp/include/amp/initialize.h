// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// amp::initialize: the front door (Apex's amp.initialize).
///
/// ```
///   Net model;                                              // as the program holds it
///   torch::optim::Adam optimizer(model.parameters(), 1e-3);
///   amp::initialize(model, optimizer, amp::O2);             // or "O2", or amp::Options
/// ```
///
/// amp changes the program's own objects in place; nothing is returned that
/// must be used instead. The model is prepared for the opt level, and amp's
/// dispatcher interception starts (O1-O6). The program keeps calling its own
/// optimizer.step(), zero_grad(), add_param_group(), torch::save / torch::load
/// and LR schedulers, and passes its objects to functions taking
/// torch::optim::Optimizer& as before.
///
/// Models and optimizers are taken as the program holds them (internal/refs.h): objects
/// by value or by reference, TORCH_MODULE holders, std::shared_ptr to a module
/// or to an optimizer of any class. Several of each go in braces:
///
/// ```
///   amp::initialize({generator, discriminator}, {opt_g, opt_d}, options);
/// ```
///
/// What the levels do to the program's objects (opt_levels.h has the table):
///   - O0, O1, O4: nothing; the model stays float32.
///   - O2, O5 (master weights): between iterations every parameter and buffer
///     of the models keeps its float32 value - the master weight the
///     program's optimizer steps, torch::save writes and torch::load fills.
///     For forward and backward amp holds them in the low dtype (float16 /
///     bfloat16), except affine BatchNorm and keep_fp32 modules: from the
///     first op that records a graph on them - a view or indexed read of
///     a weight (wpe.narrow, w.t(), index_select), or an op where they meet
///     activations - until the end of the scale_loss guard, so every op of a
///     forward sees the low dtype whichever comes first. Evaluation under
///     torch::NoGradGuard reads the float32 weights and casts per op.
///   - O3, O6 (and O2/O5 without an optimizer, or with master_weights = false):
///     the models are converted to the low dtype for good.
///
/// Optimizers are not changed: their parameter groups, state and algorithm
/// stay theirs. amp's scale_loss guard decides, per optimizer, whether its
/// next step() may run: after a gradient overflow it leaves the optimizer no
/// gradients, so its own step() changes nothing (fused.h has optimizers whose
/// step needs no host read for that).
///
/// Code written for the form that returned the objects keeps working: with
/// shared pointers (or holders) the call returns them, so
/// ```
///   std::tie(model, optimizer) = amp::initialize(model, optimizer, amp::O2);
/// ```
/// assigns the same objects back.
///
/// amp stays active until amp::deinitialize() - or, for an initialization
/// made through a Handle, until handle.deinitialize() or the handle's
/// destruction - which removes every dispatcher registration and thread-state
/// change amp made and leaves O2/O5 models in float32: LibTorch (native
/// at::autocast included) behaves exactly as before, and the same objects may
/// be initialized again. Call it on the thread that called initialize, once
/// no other thread uses amp's casting. At most one initialization is live.
/// One still live when the process exits is left as it is: exit runs no
/// teardown and no collective (the ranks may leave at different times, and
/// the CUDA runtime may be unloading), so a data-parallel program ends it
/// itself before main returns (data_parallel.h).
///
/// Errors (c10::Error; nothing is changed when initialize throws):
///   - the LibTorch the program runs with is of another minor version than
///     the one amp was compiled against (a libtorch swapped on the library
///     path: rebuild against the one it runs with);
///   - amp is already initialized (deinitialize first);
///   - an invalid opt level or override (see opt_levels.h), num_losses < 1,
///     verbosity outside 0..2;
///   - a null model or optimizer; the same optimizer twice;
///   - a model wrapped in a data-parallel wrapper (wrap after initialize);
///   - parameters on more than one device;
///   - a parameter or buffer whose storage holds another dtype's bytes (an
///     earlier torch::load of a checkpoint with other dtypes);
///   - at O2/O3/O5, an Embedding or EmbeddingBag with sparse=true (sparse
///     gradients are supported at O0, O1 and O4);
///   - Options::data_parallel's errors (data_parallel.h);
///   - Options::fp8_scaling out of range (options.h); fp8 with a model on a
///     CUDA device without float8 GEMM kernels (compute capability < 8.9);
///   - Options::measured_policy_timer set without measured_policy.
///
/// With Options::data_parallel.group, initialize is a collective: every rank
/// calls it, and every rank's models take rank 0's weights.
/// Compile errors: an argument that is no model or optimizer, or more than
/// three arguments (static_assert messages say what to pass).
/// Warnings (stderr, verbosity >= 1): a model that is already low precision
/// when initialize converts it, or not float32 at O0; an optimizer (Adam,
/// AdamW, RMSprop, Adagrad) whose eps is 0 in the dtype it would update
/// without master weights (O3 float16 with eps=1e-8: NaN after one step), or
/// with any eps in float16, whose squared gradients flush to zero below 6e-8
/// (O3 float16 with Adam diverges; bfloat16 does not).
#pragma once

#include <amp/loss_scaler.h>
#include <amp/options.h>
#include <amp/internal/global_handle.h>
#include <amp/internal/refs.h>

#include <initializer_list>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace amp {

namespace detail {
class Context;
}  // namespace detail


/// Owns one initialization of amp, for code that wants it scoped:
///
/// ```
///   {
///     amp::Handle handle;
///     handle.initialize(model, optimizer, amp::O2);
///     ...                                   // amp is live
///   }                                       // ended here, LibTorch as before
/// ```
///
/// Only its handle ends it: amp::deinitialize() refuses (see below), so code
/// elsewhere cannot end a scope's mixed precision under it. The free
/// amp::initialize() uses a process-wide handle.
class Handle {
 public:
  Handle() = default;
  ~Handle();
  /// Takes over the other handle's initialization.
  Handle(Handle&&) noexcept = default;
  Handle& operator=(Handle&&) = delete;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  /// (model), (model, level), (model, optimizer) or (model, optimizer, level);
  /// a std::vector of models and one of optimizers work the same way. Returns
  /// what it was given - the model, or the pair (model, optimizer) - when
  /// that is shared pointers or holders (or vectors of them); nothing
  /// otherwise.
  template <class Model, class... Rest>
  decltype(auto) initialize(Model&& model, Rest&&... rest);

  /// Several models and optimizers, each held any way internal/refs.h accepts.
  ///@{
  void initialize(std::initializer_list<internal::ModelRef> models,
                  std::initializer_list<internal::OptimizerRef> optimizers, const Options& options = {}) {
    initialize_refs(std::vector<internal::ModelRef>(models), std::vector<internal::OptimizerRef>(optimizers), options);
  }
  void initialize(std::initializer_list<internal::ModelRef> models, const Options& options) {
    initialize_refs(std::vector<internal::ModelRef>(models), {}, options);
  }
  ///@}
  /// Vectors of shared pointers, as code written for the form that returned
  /// them passes (the variadic form above takes vectors too).
  std::pair<std::vector<std::shared_ptr<torch::nn::Module>>, std::vector<std::shared_ptr<torch::optim::Optimizer>>> initialize(
      const std::vector<std::shared_ptr<torch::nn::Module>>& models, const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers,
      const Options& options = {}) {
    initialize_refs(std::vector<internal::ModelRef>(models.begin(), models.end()),
                    std::vector<internal::OptimizerRef>(optimizers.begin(), optimizers.end()), options);
    return {models, optimizers};
  }
  /// Ends this handle's initialization if it is still live; a no-op
  /// otherwise. Errors: as amp::deinitialize(), except that it ends a
  /// handle's initialization.
  void deinitialize();
  /// Whether this handle's initialization is the live one.
  bool active() const;

 private:
  void initialize_refs(const std::vector<internal::ModelRef>& models,
                       const std::vector<internal::OptimizerRef>& optimizers, const Options& options);

  std::shared_ptr<detail::Context> context_;
};

/// amp::initialize: prepares the program's models and optimizers for the opt
/// level and starts amp, through a process-wide handle (see initialize.h).
/// It takes the forms Handle::initialize takes, and returns what they return.
///@{
template <class Model, class... Rest>
decltype(auto) initialize(Model&& model, Rest&&... rest) {
  return internal::global_handle().initialize(std::forward<Model>(model), std::forward<Rest>(rest)...);
}
inline void initialize(std::initializer_list<internal::ModelRef> models,
                       std::initializer_list<internal::OptimizerRef> optimizers, const Options& options = {}) {
  internal::global_handle().initialize(models, optimizers, options);
}
inline void initialize(std::initializer_list<internal::ModelRef> models, const Options& options) {
  internal::global_handle().initialize(models, options);
}
inline std::pair<std::vector<std::shared_ptr<torch::nn::Module>>, std::vector<std::shared_ptr<torch::optim::Optimizer>>> initialize(
    const std::vector<std::shared_ptr<torch::nn::Module>>& models, const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers,
    const Options& options = {}) {
  return internal::global_handle().initialize(models, optimizers, options);
}
///@}
/// Ends the initialization made by amp::initialize. Errors (nothing changes):
/// amp is not initialized; the live initialization belongs to an amp::Handle
/// (end it with handle.deinitialize() or by destroying the handle); called
/// from another thread than initialize; enable_casts scopes still alive on
/// other threads.
void deinitialize();
/// Whether an initialization - amp::initialize's or a Handle's - is live.
bool is_initialized();

/// The live initialization's resolved properties. Errors: not initialized.
Properties properties();


/// The live initialization's scaler for `loss_id`: its knobs, its device
/// state. Shared with amp, so it stays valid after deinitialize (the final
/// scale can still be read); a later initialize makes new scalers. Errors:
/// not initialized, loss_id out of range.
std::shared_ptr<LossScaler> loss_scaler(int loss_id = 0);

// ---- Implementation ----


template <class Model, class... Rest>
decltype(auto) Handle::initialize(Model&& model, Rest&&... rest) {
  static_assert(internal::kIsModels<Model>,
                "amp::initialize(model, optimizer, opt_level): pass the model as the program holds "
                "it: a torch::nn::Module object, a TORCH_MODULE holder, or a std::shared_ptr to a "
                "module (several models go in braces: {a, b})");
  static_assert(sizeof...(Rest) <= 2, "amp::initialize takes (model, optimizer, opt_level)");
  if constexpr (internal::kIsModels<Model> && sizeof...(Rest) <= 2) {
    if constexpr (sizeof...(Rest) == 0) {
      initialize_refs(internal::to_refs<internal::ModelRef>(model), {}, Options{});
      if constexpr (internal::kReturnable<Model>) return std::decay_t<Model>(model);
    } else {
      auto&& second = std::get<0>(std::forward_as_tuple(rest...));
      using Second = decltype(second);
      if constexpr (std::is_convertible_v<Second, Options>) {
        static_assert(sizeof...(Rest) == 1, "amp::initialize(model, opt_level): the opt level comes last");
        initialize_refs(internal::to_refs<internal::ModelRef>(model), {}, Options(second));
        if constexpr (internal::kReturnable<Model>) return std::decay_t<Model>(model);
      } else {
        static_assert(internal::kIsOptimizers<Second>,
                      "amp::initialize(model, optimizer, opt_level): pass the optimizer as the "
                      "program holds it: a torch::optim::Optimizer object, a reference to one, or a "
                      "std::shared_ptr to one; the opt level is amp::O2, \"O2\" or amp::Options");
        if constexpr (internal::kIsOptimizers<Second>) {
          Options options;
          if constexpr (sizeof...(Rest) == 2) {
            auto&& third = std::get<1>(std::forward_as_tuple(rest...));
            static_assert(std::is_convertible_v<decltype(third), Options>,
                          "amp::initialize(model, optimizer, opt_level): the opt level is amp::O2, "
                          "\"O2\" or amp::Options");
            options = Options(third);
          }
          initialize_refs(internal::to_refs<internal::ModelRef>(model), internal::to_refs<internal::OptimizerRef>(second), options);
          if constexpr (internal::kReturnable<Model> && internal::kReturnable<Second>) {
            return std::pair<std::decay_t<Model>, std::decay_t<Second>>(model, second);
          }
        }
      }
    }
  }
}

}  // namespace amp
