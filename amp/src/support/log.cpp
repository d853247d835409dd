// SPDX-License-Identifier: BSD-3-Clause
#include "support/log.h"

#include <iostream>
#include <mutex>

namespace amp {
namespace {

std::mutex g_sink_mutex;
LogSink g_sink;

}  // namespace

LogSink set_log_sink(LogSink sink) {
  std::lock_guard<std::mutex> lock(g_sink_mutex);
  return std::exchange(g_sink, std::move(sink));
}

namespace detail {

void emit(const LogEvent& event) {
  LogSink sink;
  {
    std::lock_guard<std::mutex> lock(g_sink_mutex);
    sink = g_sink;
  }
  if (sink) {
    sink(event);
  } else if (event.kind == LogEvent::Kind::kProperties) {
    std::cerr << event.message << std::flush;
  } else {
    const char* prefix = event.kind == LogEvent::Kind::kWarning ? "warning: "
                         : event.kind == LogEvent::Kind::kNote  ? "note: "
                         : event.kind == LogEvent::Kind::kError ? "error: "
                                                                : "";
    std::cerr << "amp: " << prefix << event.message << std::endl;
  }
}

}  // namespace detail
}  // namespace amp
