// SPDX-License-Identifier: BSD-3-Clause
#include "support/host_read.h"

#include <ATen/ATen.h>

#include <atomic>
#include <map>
#include <string>
#include <utility>

namespace amp::detail {
namespace {

std::atomic<int64_t> g_host_reads{0};

}  // namespace

void count_host_read() { g_host_reads.fetch_add(1, std::memory_order_relaxed); }

int64_t host_reads() { return g_host_reads.load(std::memory_order_relaxed); }

std::vector<double> read_to_host(const std::vector<at::Tensor>& tensors) {
  // amp's own ops, not the user's forward: overflow provenance must not
  // take this copy of an earlier report's inf/NaN for a new overflow.
  at::NoGradGuard no_grad;
  // Per device: its tensors' values in one buffer, and where each starts in the result.
  std::map<std::string, std::pair<std::vector<at::Tensor>, std::vector<size_t>>> by_device;
  std::vector<size_t> starts;
  size_t total = 0;
  for (const at::Tensor& t : tensors) {
    auto& [values, owners] = by_device[t.device().str()];
    values.push_back(t.reshape({-1}).to(at::kDouble));
    owners.push_back(starts.size());
    starts.push_back(total);
    total += static_cast<size_t>(t.numel());
  }
  std::vector<double> out(total);
  for (const auto& [device, entry] : by_device) {
    const at::Tensor host = at::cat(entry.first).cpu();
    count_host_read();
    const double* v = host.data_ptr<double>();
    for (size_t i = 0; i < entry.first.size(); ++i) {
      const int64_t n = entry.first[i].numel();
      std::copy(v, v + n, out.begin() + static_cast<std::ptrdiff_t>(starts[entry.second[i]]));
      v += n;
    }
  }
  return out;
}

}  // namespace amp::detail
