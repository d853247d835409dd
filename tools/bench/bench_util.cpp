#include "bench_util.h"

namespace bench {
namespace {
thread_local OpCounter* t_counter = nullptr;
}

OpCounter::OpCounter(std::vector<std::string> prefixes) : prefixes_(std::move(prefixes)) {
  t_counter = this;
  handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&OpCounter::on_start)
                                           .scopes({at::RecordScope::FUNCTION}));
}

OpCounter::~OpCounter() {
  at::removeCallback(handle_);
  t_counter = nullptr;
}

std::unique_ptr<at::ObserverContext> OpCounter::on_start(const at::RecordFunction& fn) {
  if (OpCounter* c = t_counter) {
    const std::string name = fn.name();
    for (const auto& p : c->prefixes_) {
      if (name.rfind(p, 0) == 0) {
        ++c->count_;
        break;
      }
    }
  }
  return nullptr;
}

}  // namespace bench
