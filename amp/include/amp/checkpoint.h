// One-file checkpoints of a mixed-precision run: models, optimizers, amp.
//
//   amp::save_checkpoint("run.pt", {model}, {optimizer});
//   ...  // later, after amp::initialize with the same options:
//   amp::load_checkpoint("run.pt", {model}, {optimizer});
//
// The file holds "model<i>" (each model's weights in torch::nn::Module's own
// archive layout and in float32: every parameter that has an fp32 master is
// saved as that master, other low-precision tensors are widened exactly, so
// an fp32 model loads them with model->load(archive)), "optimizer<i>" (the optimizer's state,
// masters included) and "amp" (amp::save_state). Resuming continues
// bit-identically.
//
// Errors (c10::Error): amp is not initialized; the file is missing,
// truncated or corrupt; an entry is missing or has another shape or kind of
// dtype; a different number of models or optimizers; any error of
// load_state (state.h) or of an optimizer's load (optimizer.h). Loading is
// all-or-nothing: on any error models, optimizers and loss scalers are
// exactly as before the call.
#pragma once

#include <amp/initialize.h>

#include <string>
#include <vector>

namespace amp {

void save_checkpoint(const std::string& path, const std::vector<ModulePtr>& models,
                     const std::vector<OptimizerPtr>& optimizers);
void load_checkpoint(const std::string& path, const std::vector<ModulePtr>& models,
                     const std::vector<OptimizerPtr>& optimizers);

}  // namespace amp
