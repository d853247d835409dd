// SPDX-License-Identifier: BSD-3-Clause
// A c10d process group of one rank, in one process: a broadcast or a sum
// over one rank leaves the tensors, a gather or reduce-scatter copies. It
// counts the all-reduces and reduce-scatters started. For tests of the
// data-parallel paths without other processes.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

namespace amp::testing {

struct DoneWork : c10d::Work {
  bool wait(std::chrono::milliseconds) override { return true; }
  std::vector<at::Tensor> held;  // as Gloo's work holds its tensors until it goes
};

struct WorldOfOne : c10d::Backend {
  WorldOfOne() : c10d::Backend(0, 1) {}
  const std::string getBackendName() const override { return "world_of_one"; }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>&, const c10d::BroadcastOptions&) override {
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    ++allreduces;
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>&,
                                                     const c10d::AllreduceCoalescedOptions&) override {
    ++allreduces;
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions&) override {
    ++reduce_scatters;
    out.copy_(in);
    return c10::make_intrusive<DoneWork>();
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions&) override {
    out.copy_(in);
    auto work = c10::make_intrusive<DoneWork>();
    work->held = {out, in};
    return work;
  }
  std::atomic<int> allreduces{0}, reduce_scatters{0};
};

}  // namespace amp::testing
