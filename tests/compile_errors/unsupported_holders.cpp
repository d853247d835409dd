// SPDX-License-Identifier: BSD-3-Clause
// Programs that hand amp something it cannot take: each function below must
// fail to compile with one static_assert that says what to pass, and nothing
// else (check_compile_errors.cmake compiles them together).
#include <amp/amp.h>

#include <memory>

struct Net : torch::nn::Module {};

// 1: a std::unique_ptr model.
void unique_ptr_model(torch::optim::SGD& sgd) {
  auto owned = std::make_unique<Net>();
  amp::initialize(owned, sgd, amp::O1);
}

// 2: a raw pointer to the optimizer.
void optimizer_pointer(Net& model, torch::optim::SGD& sgd) { amp::initialize(model, &sgd, amp::O1); }

// 3: a raw pointer to the optimizer, in the guard.
void optimizer_pointer_in_the_guard(torch::optim::SGD& sgd) { amp::scale_loss scaled(torch::ones({}), &sgd); }

int main() {}
