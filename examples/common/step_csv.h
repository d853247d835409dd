// SPDX-License-Identifier: BSD-3-Clause
// --csv=FILE: each training step's loss and loss scale as "step,loss,loss_scale"
// rows, for plotting (tools/plot_training.sh) or comparing runs step by step.
// The loss is written with 9 significant digits, enough to give back a
// float32 loss exactly, so two runs' curves can be compared to the last bit.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace examples {

class StepCsv {
 public:
  // An empty `path` writes nothing; a path that cannot be written throws
  // std::invalid_argument before training starts.
  explicit StepCsv(const std::string& path);

  void add(int64_t step, double loss, double loss_scale);

 private:
  std::ofstream out_;
};

}  // namespace examples
