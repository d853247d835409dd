// SPDX-License-Identifier: BSD-3-Clause
#include "common/graphed_step.h"

#include <stdexcept>
#include <utility>

#ifdef AMP_EXAMPLES_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace examples {

#ifdef AMP_EXAMPLES_WITH_CUDA
struct GraphedStep::Graph {
  c10::cuda::CUDAStreamGuard side{c10::cuda::getStreamFromPool()};
  at::cuda::CUDAGraph graph;
};
#else
struct GraphedStep::Graph {};
#endif

GraphedStep::GraphedStep(bool graphed, std::function<void()> step, std::function<void()> before_capture)
    : graphed_(graphed), step_(std::move(step)), before_capture_(std::move(before_capture)) {
  if (graphed_) graph_ = std::make_unique<Graph>();  // the warm-up on the stream the capture will use
}

GraphedStep::~GraphedStep() = default;

void GraphedStep::operator()() {
  const int call = calls_++;
  if (!graphed_ || call < kWarmupSteps) {
    step_();
    return;
  }
#ifdef AMP_EXAMPLES_WITH_CUDA
  if (call == kWarmupSteps) {
    before_capture_();
    graph_->graph.capture_begin();
    step_();
    graph_->graph.capture_end();
  }
  graph_->graph.replay();
#endif
}

void check_cuda_graph(c10::Device device, bool fused_optimizer, const amp::Options& options,
                      const std::string& inject_non_finite) {
#ifndef AMP_EXAMPLES_WITH_CUDA
  throw std::invalid_argument("--cuda_graph: this build's LibTorch has no CUDA; build against a CUDA LibTorch, "
                              "or run without --cuda_graph");
#endif
  if (options.stochastic_rounding.value_or(options.opt_level == amp::O6) ||
      options.optimizer_state_dtype == at::kByte) {
    throw std::invalid_argument("--cuda_graph cannot replay O6's stochastic rounding or 8-bit state, which draw "
                                "fresh noise every step (a replay would round with one step's noise): use O5, or "
                                "run without --cuda_graph");
  }
  if (!device.is_cuda()) {
    throw std::invalid_argument("--cuda_graph captures the step's GPU work and needs --device=cuda; on the CPU "
                                "run without it");
  }
  if (!fused_optimizer) {
    throw std::invalid_argument("--cuda_graph needs amp's fused optimizer (--optimizer=fused, the default with "
                                "--cuda_graph): LibTorch's reads the overflow verdict on the host every step, which "
                                "a replay cannot");
  }
  const std::string host_flag = !inject_non_finite.empty() ? "--inject_non_finite"
                                : options.measured_policy   ? "--measured_policy"
                                                            : "";
  if (!host_flag.empty()) {
    throw std::invalid_argument("--cuda_graph cannot replay " + host_flag +
                                ", whose work happens on the host every step: use one or the other");
  }
}

}  // namespace examples
