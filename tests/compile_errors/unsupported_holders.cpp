// Programs that hand amp something it cannot take: each VARIANT must fail to
// compile with one static_assert that says what to pass
// (check_compile_errors.cmake runs them).
#include <amp/amp.h>

#include <memory>

struct Net : torch::nn::Module {};

int main() {
  Net model;
  torch::optim::SGD sgd(model.parameters(), 0.1);
#if VARIANT == 1  // a std::unique_ptr model
  auto owned = std::make_unique<Net>();
  amp::initialize(owned, sgd, amp::O1);
#elif VARIANT == 2  // a raw pointer to the optimizer
  amp::initialize(model, &sgd, amp::O1);
#elif VARIANT == 3  // a raw pointer to the optimizer, in the guard
  amp::scale_loss scaled(torch::ones({}), &sgd);
#endif
}
