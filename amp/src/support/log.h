// SPDX-License-Identifier: BSD-3-Clause
// Private: emitting amp's log events (amp/log.h) to the program's sink, or
// to stderr.
#pragma once

#include <amp/log.h>

#include <string>

namespace amp::detail {

void emit(const LogEvent& event);

inline void warn(std::string code, std::string message) {
  emit({LogEvent::Kind::kWarning, std::move(code), std::move(message)});
}
inline void log_error(std::string message) { emit({LogEvent::Kind::kError, "", std::move(message)}); }

}  // namespace amp::detail
