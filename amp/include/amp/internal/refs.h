// SPDX-License-Identifier: BSD-3-Clause
// Internal: how amp takes the program's models and optimizers - the way the
// program already holds them. Programs never name these types: they pass
// their objects, and these adapters convert implicitly.
//
//   Net model;                                         // by value (LibTorch's MNIST example)
//   torch::optim::Adam optimizer(model.parameters());  // by value
//   amp::initialize(model, optimizer, amp::O2);
//
//   Net net;                                           // a TORCH_MODULE holder
//   auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
//   amp::initialize(net, sgd, "O1");                   // std::shared_ptr<Concrete>
//
// A ModelRef is made from a torch::nn::Module object (or a reference to
// one), a TORCH_MODULE holder (nn::Sequential included), or a
// std::shared_ptr to a module; an OptimizerRef from a torch::optim::Optimizer
// object or reference, or a std::shared_ptr to one. Both only point: the
// program keeps owning its objects and must keep them alive while amp uses
// them. Anything else (a raw pointer, a std::unique_ptr, a const object) is
// refused at compile time by a static_assert that says what to pass.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <initializer_list>
#include <memory>
#include <type_traits>
#include <vector>

namespace amp::internal {

template <class T>
struct SharedPointee {
  using type = void;
};
template <class T>
struct SharedPointee<std::shared_ptr<T>> {
  using type = T;
};

// A mutable object of class Base or derived from it.
template <class T, class Base>
inline constexpr bool kIsObject = std::is_base_of_v<Base, std::remove_reference_t<T>> &&
                                  !std::is_const_v<std::remove_reference_t<T>>;
template <class T, class Base>
inline constexpr bool kIsSharedPtr =
    std::is_base_of_v<Base, typename SharedPointee<std::decay_t<T>>::type>;

template <class T>
inline constexpr bool kIsModel = kIsObject<T, torch::nn::Module> ||
                                 kIsSharedPtr<T, torch::nn::Module> ||
                                 std::is_base_of_v<torch::detail::ModuleHolderIndicator, std::decay_t<T>>;
template <class T>
inline constexpr bool kIsOptimizer =
    kIsObject<T, torch::optim::Optimizer> || kIsSharedPtr<T, torch::optim::Optimizer>;

template <class T>
inline constexpr bool kAlwaysFalse = false;

class ModelRef {
 public:
  template <class T, std::enable_if_t<kIsObject<T, torch::nn::Module>, int> = 0>
  ModelRef(T& module) : module_(&module) {}  // NOLINT: implicit by design
  template <class T, std::enable_if_t<std::is_base_of_v<torch::nn::Module, T>, int> = 0>
  ModelRef(const std::shared_ptr<T>& module) : module_(module.get()) {}  // NOLINT
  template <class T>
  ModelRef(const torch::nn::ModuleHolder<T>& holder)  // NOLINT
      : module_(holder.is_empty() ? nullptr : holder.ptr().get()) {}
  template <class T, std::enable_if_t<!kIsModel<T>, int> = 0>
  ModelRef(const T&) {  // NOLINT
    static_assert(kAlwaysFalse<T>,
                  "amp: pass a model as the program holds it: a torch::nn::Module object "
                  "(Net model;), a TORCH_MODULE holder, or a std::shared_ptr to a module");
  }

  // The module, or null for an empty holder or null pointer.
  torch::nn::Module* get() const { return module_; }

 private:
  torch::nn::Module* module_ = nullptr;
};

class OptimizerRef {
 public:
  template <class T, std::enable_if_t<kIsObject<T, torch::optim::Optimizer>, int> = 0>
  OptimizerRef(T& optimizer) : optimizer_(&optimizer) {}  // NOLINT: implicit by design
  template <class T, std::enable_if_t<std::is_base_of_v<torch::optim::Optimizer, T>, int> = 0>
  OptimizerRef(const std::shared_ptr<T>& optimizer) : optimizer_(optimizer.get()) {}  // NOLINT
  template <class T, std::enable_if_t<!kIsOptimizer<T>, int> = 0>
  OptimizerRef(const T&) {  // NOLINT
    static_assert(kAlwaysFalse<T>,
                  "amp: pass an optimizer as the program holds it: a torch::optim::Optimizer "
                  "object (torch::optim::Adam optimizer(...);), a reference to one, or a "
                  "std::shared_ptr to one");
  }

  // The optimizer, or null for a null pointer.
  torch::optim::Optimizer* get() const { return optimizer_; }

 private:
  torch::optim::Optimizer* optimizer_ = nullptr;
};

// Several models or optimizers: in braces ({model, other}) or as a
// std::vector of anything one ModelRef / OptimizerRef takes.
template <class Ref>
class RefList {
 public:
  RefList(std::initializer_list<Ref> refs) : refs_(refs) {}  // NOLINT: implicit by design
  template <class T>
  RefList(const std::vector<T>& items) : refs_(items.begin(), items.end()) {}  // NOLINT
  const std::vector<Ref>& items() const { return refs_; }

 private:
  std::vector<Ref> refs_;
};
using ModelRefs = RefList<ModelRef>;
using OptimizerRefs = RefList<OptimizerRef>;

// amp::initialize's forms: what a model or optimizer argument may be, and
// whether initialize returns it.
template <class T>
struct VectorElement {
  using type = void;
};
template <class T>
struct VectorElement<std::vector<T>> {
  using type = T;
};
template <class T>
using Element = typename VectorElement<std::decay_t<T>>::type;

// Shared pointers and holders: what initialize hands back.
template <class T>
inline constexpr bool kIsHandle =
    kIsSharedPtr<T, torch::nn::Module> || kIsSharedPtr<T, torch::optim::Optimizer> ||
    std::is_base_of_v<torch::detail::ModuleHolderIndicator, std::decay_t<T>>;
template <class T>
inline constexpr bool kReturnable = kIsHandle<T> || kIsHandle<Element<T>>;

template <class T>
inline constexpr bool kIsModels =
    kIsModel<T> || std::is_same_v<Element<T>, ModelRef> || kIsModel<Element<T>>;
template <class T>
inline constexpr bool kIsOptimizers =
    kIsOptimizer<T> || std::is_same_v<Element<T>, OptimizerRef> || kIsOptimizer<Element<T>>;

template <class Ref, class T>
std::vector<Ref> to_refs(T& x) {
  if constexpr (std::is_void_v<Element<T>>) {
    return {Ref(x)};
  } else {
    return std::vector<Ref>(x.begin(), x.end());
  }
}

}  // namespace amp::internal
