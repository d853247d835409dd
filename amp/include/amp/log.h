// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// amp's log: what amp tells the program - the resolved level, skipped
/// steps, warnings and notes - as structured events.
///
/// By default each event is printed to stderr as "amp: <message>" (the
/// properties table as it is). A sink routes them elsewhere instead: the
/// program's own logger, a metrics counter, or a test that inspects them.
///
/// ```
///   amp::set_log_sink([](const amp::LogEvent& e) {
///     if (e.kind == amp::LogEvent::Kind::kStepSkipped) skipped.inc();
///     my_logger.info("amp: {}", e.message);
///   });
/// ```
///
/// `verbosity` (options.h) decides which events are emitted at all: 0 none
/// but errors, 1 everything below. Events come from the thread that caused
/// them (a guard's end, initialize); a sink must be thread-safe if several
/// threads train.
#pragma once

#include <functional>
#include <string>

namespace amp {

/// One event of amp's log.
struct LogEvent {
  /// What happened.
  enum class Kind {
    kProperties,       ///< initialize: the resolved level's properties (message: the table)
    kStepSkipped,      ///< a gradient overflow skipped a step: loss_id, scale_before, scale_after
    kSkipsSuppressed,  ///< that many skips in a row: quiet until a step succeeds (loss_id, scale_after)
    kWarning,          ///< likely to train badly; `code` names which
    kNote,             ///< worth knowing (e.g. the CPU emulates the low dtype); `code` names which
    kError,            ///< an error amp could not raise (while destroying a handle or context)
  };
  Kind kind;  ///< what happened
  /// A stable name for warnings and notes: "model_already_low_precision",
  /// "model_not_float32_at_o0", "optimizer_eps_vanishes",
  /// "master_rebuilt_from_low_precision", "cpu_emulates_dtype",
  /// "keeps_cpu_memory" (once a process, at the first CPU initialize).
  std::string code;
  std::string message;  ///< the human-readable text, without the "amp: " prefix
  int loss_id = -1;  ///< the loss whose step was skipped (kStepSkipped, kSkipsSuppressed); -1 otherwise
  double scale_before = 0;  ///< kStepSkipped
  double scale_after = 0;   ///< kStepSkipped, kSkipsSuppressed
};

/// A receiver of amp's events (set_log_sink).
using LogSink = std::function<void(const LogEvent&)>;

/// Routes amp's events to `sink` (null: stderr, the default); returns the
/// sink it replaces.
LogSink set_log_sink(LogSink sink);

}  // namespace amp
