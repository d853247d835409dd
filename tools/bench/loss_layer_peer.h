// SPDX-License-Identifier: BSD-3-Clause
// The loss layer's Python peers (tools/bench/loss_layer_peer.py), for the
// benchmark tables that print them beside amp::linear_cross_entropy:
// gpu_benchmarks' `loss` table and memory_benchmark --loss_layer --python.
// Header-only: gpu_benchmarks links nothing but amp. Both tables print
// every way the peer has (loss_layer_peer.py's WAYS).
#pragma once

#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

// One way the peer computed the layer ("row <way> peak_mib X ms Y loss Z"),
// or why it could not ("row <way> not_run <why>").
struct LossLayerPeerRow {
  std::string way;
  std::string not_run;  // empty: it ran
  double peak_mib = 0, ms = 0, loss = 0;
};

// The peer's label for a way, as the tables print it.
inline std::string loss_layer_peer_label(const std::string& way) {
  if (way == "plain") return "Python: F.linear + F.cross_entropy (torch.autocast)";
  if (way == "compiled") return "Python: the same under torch.compile";
  if (way == "chunked") return "Python: torchtune's chunked upcast (CEWithChunkedOutputLoss, 8 chunks)";
  if (way == "liger") return "Python: Liger Kernel's fused linear cross-entropy";
  return "Python: " + way;
}

// Runs `python script` (every way) on the layer's shape and returns its
// rows. Throws with the command when it fails.
inline std::vector<LossLayerPeerRow> loss_layer_peer_rows(const std::string& python, const std::string& script,
                                                          const std::string& device, long long tokens,
                                                          long long width, long long vocab) {
  std::ostringstream command;
  command << python << ' ' << script << " --device=" << device << " --tokens=" << tokens << " --width=" << width
          << " --vocab=" << vocab;  // its stderr (a traceback) stays the caller's
  FILE* pipe = popen(command.str().c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("cannot run " + command.str());
  std::vector<LossLayerPeerRow> rows;
  char buffer[1024];
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) {
    std::istringstream line(buffer);
    std::string word, key;
    LossLayerPeerRow row;
    if (!(line >> word >> row.way) || word != "row") continue;
    line >> key;
    if (key == "not_run") {
      std::getline(line >> std::ws, row.not_run);
      if (!row.not_run.empty() && row.not_run.back() == '\n') row.not_run.pop_back();
    } else {
      line >> row.peak_mib >> word >> row.ms >> word >> row.loss;
    }
    rows.push_back(row);
  }
  if (pclose(pipe) != 0) throw std::runtime_error("the loss layer's Python peer failed: " + command.str());
  return rows;
}

// A loss-layer table's format: the unfused row its ratios divide by, the
// digits of its milliseconds, and whether it has a loss column.
struct LossLayerTable {
  double unfused_mib, unfused_ms;
  int ms_digits;
  bool loss_column;
};

// Prints the peer's rows into `table` (the Markdown rows of | loss | peak
// MiB | / unfused | ms | / unfused | [loss |]), or one row saying why the
// peer did not run.
inline void print_loss_layer_peers(const std::string& python, const std::string& script, const std::string& device,
                                   long long tokens, long long width, long long vocab, const LossLayerTable& table) {
  const char* empty = table.loss_column ? " | | | |" : " | | |";
  try {
    for (const LossLayerPeerRow& row : loss_layer_peer_rows(python, script, device, tokens, width, vocab)) {
      const std::string label = loss_layer_peer_label(row.way);
      if (!row.not_run.empty()) {
        std::printf("| %s | not run: %s%s\n", label.c_str(), row.not_run.c_str(), empty);
        continue;
      }
      std::printf("| %s | %.1f | %.3f | %.*f | %.2f |", label.c_str(), row.peak_mib, row.peak_mib / table.unfused_mib,
                  table.ms_digits, row.ms, row.ms / table.unfused_ms);
      if (table.loss_column) std::printf(" %.5f |", row.loss);
      std::printf("\n");
    }
  } catch (const std::exception& e) {
    std::printf("| Python peers | not run: %s%s\n", e.what(), empty);
  }
  std::fflush(stdout);
}

}  // namespace bench
