// SPDX-License-Identifier: BSD-3-Clause
#include "bench_util.h"

#include <set>
#include <string>

namespace bench {
namespace {
thread_local OpCounter* t_counter = nullptr;
thread_local LaunchCounter* t_launches = nullptr;

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

bool metadata_only(const std::string& name) {
  static const std::set<std::string> names = {
      "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::narrow", "aten::slice", "aten::select",
      "aten::as_strided", "aten::t", "aten::transpose", "aten::permute", "aten::expand", "aten::unsqueeze",
      "aten::squeeze", "aten::_unsafe_view", "aten::alias", "aten::detach", "aten::detach_", "aten::resolve_conj",
      "aten::resolve_neg", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::contiguous", "aten::to",
      "aten::lift_fresh", "aten::result_type", "aten::_has_compatible_shallow_copy_type", "aten::item",
      "aten::_local_scalar_dense"};
  return names.count(name) > 0;
}
}  // namespace

LaunchCounter::LaunchCounter() {
  t_launches = this;
  handle_ = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&LaunchCounter::on_start, &LaunchCounter::on_end).scopes({at::RecordScope::FUNCTION}));
}

LaunchCounter::~LaunchCounter() {
  at::removeCallback(handle_);
  t_launches = nullptr;
}

std::unique_ptr<at::ObserverContext> LaunchCounter::on_start(const at::RecordFunction& fn) {
  LaunchCounter* c = t_launches;
  if (c == nullptr) return nullptr;
  const std::string name = fn.name();
  if (!c->frames_.empty()) c->frames_.back().has_child = true;
  const bool inside_opaque = !c->frames_.empty() && c->frames_.back().opaque;
  const bool opaque = inside_opaque || starts_with(name, "aten::_foreach_") || starts_with(name, "aten::_fused_") ||
                      name == "aten::_scaled_mm";
  if (opaque && !inside_opaque) ++c->count_;
  c->frames_.push_back({opaque, inside_opaque || metadata_only(name), false});
  return nullptr;
}

void LaunchCounter::on_end(const at::RecordFunction&, at::ObserverContext*) {
  LaunchCounter* c = t_launches;
  if (c == nullptr || c->frames_.empty()) return;
  const Frame frame = c->frames_.back();
  c->frames_.pop_back();
  if (!frame.opaque && !frame.metadata && !frame.has_child) ++c->count_;
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
