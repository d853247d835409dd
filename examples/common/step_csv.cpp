// SPDX-License-Identifier: BSD-3-Clause
#include "common/step_csv.h"

#include <stdexcept>

namespace examples {

StepCsv::StepCsv(const std::string& path) {
  if (path.empty()) return;
  out_.open(path);
  if (!out_) throw std::invalid_argument("--csv: cannot write " + path + " (does its folder exist?)");
  out_.precision(9);
  out_ << "step,loss,loss_scale\n";
}

void StepCsv::add(int64_t step, double loss, double loss_scale) {
  if (out_.is_open()) out_ << step << ',' << loss << ',' << loss_scale << '\n';
}

}  // namespace examples
