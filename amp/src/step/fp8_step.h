// SPDX-License-Identifier: BSD-3-Clause
// Private: the fp8 property as a step participant - when a guard that ends
// an iteration (not delay_unscale) commits, every float8 GEMM site takes its
// next scales from its amax history (fp8/fp8_gemms.h). An unwound guard
// updates nothing: its iteration's amaxes stay in the history's first slot.
#pragma once

#include "fp8/fp8_gemms.h"
#include "step/guard.h"
#include "step/step_participant.h"

#include <memory>

namespace amp::detail {

class Fp8Participant final : public StepParticipant {
 public:
  explicit Fp8Participant(Fp8Gemms& gemms) : gemms_(gemms) {}

  std::unique_ptr<GuardPart> open(Guard&) override { return std::make_unique<Part>(gemms_); }

 private:
  struct Part final : GuardPart {
    explicit Part(Fp8Gemms& gemms) : gemms(gemms) {}
    // In prepare, as it can fail; it is the last participant (session/
    // context.cpp), so after it nothing fails and the scales it updated in
    // place (a CUDA graph replays the update) are the committed step's.
    void prepare(Guard& guard) override {
      if (!guard.options().delay_unscale) gemms.update();
    }
    Fp8Gemms& gemms;
  };
  Fp8Gemms& gemms_;
};

}  // namespace amp::detail
