// SPDX-License-Identifier: BSD-3-Clause
// --cuda_graph: the whole training step - zero_grad, forward, the
// scale_loss guard, backward, step - captured once in a CUDA graph and
// replayed, so a step costs the host one launch instead of one per op
// (docs/guide.md, "A whole step in a CUDA graph"). The step runs eagerly
// for a few warm-up steps (the optimizer's state, its device step counts
// and the loss scale come to exist), is captured at the next and replayed
// from then on. Everything runs on a side stream: graphs are not captured
// on the default stream.
//
// The step reads its batch from tensors that keep their address - copy each
// batch into them before the call - and its loss is the one the capture
// computed, rewritten by each replay: a replay reads and writes the memory
// the capture did.
#pragma once

#include <amp/options.h>

#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>

namespace examples {

class GraphedStep {
 public:
  static constexpr int kWarmupSteps = 3;

  // `graphed` false: each call runs `step` eagerly, on the current stream.
  // `before_capture` runs once after the warm-up, before capturing (read
  // the warm-up's outcome there - amp::skipped_steps - so the capture waits
  // for nothing).
  GraphedStep(bool graphed, std::function<void()> step, std::function<void()> before_capture);
  ~GraphedStep();
  GraphedStep(const GraphedStep&) = delete;
  GraphedStep& operator=(const GraphedStep&) = delete;

  // One training step: eager for the first kWarmupSteps calls, captured and
  // replayed at the next, replayed at every later one.
  void operator()();

 private:
  struct Graph;
  bool graphed_;
  std::function<void()> step_, before_capture_;
  int calls_ = 0;
  std::unique_ptr<Graph> graph_;  // the side stream and the captured graph
};

// Throws std::invalid_argument, naming the flag and what to do, where
// --cuda_graph cannot run: O6's stochastic rounding or 8-bit state (fresh
// noise every step), not on CUDA, LibTorch's optimizer (--optimizer=
// libtorch: it reads the overflow verdict on the host every step), or a
// flag whose work happens on the host every step (--inject_non_finite, the
// value of `inject_non_finite`; --measured_policy, options.measured_policy).
// What amp itself cannot capture it refuses at the capture, with the cause.
void check_cuda_graph(c10::Device device, bool fused_optimizer, const amp::Options& options,
                      const std::string& inject_non_finite);

}  // namespace examples
