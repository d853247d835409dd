// SPDX-License-Identifier: BSD-3-Clause
/// \file
/// Options: the opt level, its overrides, and amp's own knobs.
///
/// ```
///   amp::Options options = amp::O2;         // an OptLevel or "O2" converts implicitly
///   options.keep_batchnorm_fp32 = false;    // Apex property overrides
///   options.loss_scale = amp::LossScale::Static(128);
///   options.num_losses = 3;
///   amp::initialize(model, optimizer, options);
/// ```
///
/// initialize validates everything once (see opt_levels.h for the property
/// errors); bad values are errors that name the field and the fix.
#pragma once

#include <amp/data_parallel.h>
#include <amp/measured_policy.h>
#include <amp/opt_levels.h>

#include <functional>
#include <optional>
#include <string>

namespace at {
class Tensor;
}
namespace torch::nn {
class Module;
}

namespace amp {

/// What amp::initialize takes: the opt level, its overrides (PropertyOverrides,
/// the base) and amp's own knobs (see options.h).
struct Options : PropertyOverrides {
  Options() = default;
  /// The level `level` (an OptLevel, or its name as parse_opt_level reads it)
  /// with nothing overridden; implicit, so a level converts to Options.
  ///@{
  Options(OptLevel level) : opt_level(level) {}                          // NOLINT: implicit by design
  Options(const char* level) : opt_level(parse_opt_level(level)) {}      // NOLINT
  Options(const std::string& level) : opt_level(parse_opt_level(level)) {}  // NOLINT
  ///@}

  OptLevel opt_level = OptLevel::O1;  ///< the opt level; O1 is Apex's default
  /// false: the same loop runs as plain float32 (GradScaler(enabled=False),
  /// autocast(enabled=False)): amp converts nothing, casts nothing, scales
  /// losses by 1 and never skips a step; amp::properties().enabled is false.
  /// The level and overrides are still validated, so flipping it back cannot
  /// uncover a typo. For comparing runs from one flag:
  /// ```
  ///   options.enabled = absl::GetFlag(FLAGS_amp);
  /// ```
  bool enabled = true;
  /// Independent losses, each with its own loss scaler (scale_loss's loss_id).
  int num_losses = 1;
  /// 0: silent. 1: the resolved properties at initialize, one line per skipped
  /// step. 2: also every model conversion decision.
  int verbosity = 1;
  /// Run banned ops (binary_cross_entropy on CUDA) in float32 instead of
  /// raising an error.
  bool allow_banned = false;
  /// O2/O3/O5: modules for which this returns true keep their own parameters
  /// and buffers in float32 (like affine BatchNorm), e.g. a custom norm layer:
  /// ```
  ///   options.keep_fp32 = [](const torch::nn::Module& m) { return m.name() == "RMSNorm"; };
  /// ```
  std::function<bool(const torch::nn::Module&)> keep_fp32;
  /// Data-parallel training over a c10d process group (distributed.h):
  /// amp averages the gradients across ranks and agrees every overflow.
  /// ```
  ///   options.data_parallel.group = process_group;
  /// ```
  DataParallel data_parallel;
  /// For loops that all-reduce gradients themselves: combines every rank's
  /// overflow flag (a 1-element float tensor, > 0 on overflow) before the
  /// scale update, so all ranks skip together. Set it with
  /// amp::overflow_all_reduce(process_group) (distributed.h).
  std::function<void(at::Tensor& found_inf)> reduce_overflow;
  /// Record, on the device, where an overflow comes from, to say after a
  /// skipped step which forward op and backward node produced the first
  /// inf/NaN and which gradients held one (amp::last_overflow, overflow.h;
  /// and the skip log). No host sync on healthy steps; a few small kernels
  /// per forward op and backward node.
  bool overflow_provenance = false;
  /// Record, on the device, each guard's gradient underflow and largest
  /// magnitude per parameter, and the loss scale history
  /// (amp::precision_telemetry, telemetry.h). No host sync on healthy steps;
  /// a few kernels per parameter group per guard.
  bool precision_telemetry = false;
  /// Run a GEMM or convolution in float32 where its low-precision kernel is
  /// measured slower at that shape on this device (measured_policy.h): O1
  /// that never costs more than it gives. Off: op for op native autocast.
  bool measured_policy = false;
  /// How the measured policy times a shape (measured_policy.h); unset: the
  /// fastest of a few wall-clock runs. Set only with measured_policy.
  MeasuredPolicyTimer measured_policy_timer;
  /// A CPU session's steps reuse the memory the step before freed. glibc's
  /// malloc gives large freed blocks back to the kernel, and the next step
  /// faults every page in again, zeroed: on the character transformer at O1
  /// that was a fifth of the step (BENCHMARKS.md). On, malloc serves blocks
  /// up to 32 MiB from the heap and keeps its freed top (up to 2 GiB), the
  /// reuse PyTorch's CPU launcher gets by preloading TCMalloc, and as the
  /// CUDA caching allocator keeps device memory: the process holds up to its
  /// peak heap.
  /// Process-wide, set once at the first CPU initialize (which logs the note
  /// "keeps_cpu_memory", log.h), and kept after deinitialize; nothing with a
  /// C library other than glibc. false: malloc as it was.
  bool keep_cpu_memory = true;
  /// With the fp8 property (opt_levels.h): how the float8 GEMMs scale their
  /// operands. Per GEMM, each operand (input, weight, incoming gradient) has
  /// its own scale, kept on the device: the operand is multiplied by it,
  /// saturated to the format's largest value and rounded to float8, and the
  /// GEMM multiplies the result by the inverse scales.
  /// ```
  ///   kDelayed (Transformer Engine's delayed scaling): the scale comes from
  ///     the amax history of earlier iterations: amax = the history's max
  ///     (kMax) or its latest entry (kMostRecent), and
  ///       scale = fp8_max / amax / 2^margin
  ///     (kept as it was where amax is 0 or not finite); each iteration's
  ///     amax enters the history when its guard commits, which rolls it by
  ///     one. Before the first commit a GEMM scales by its current amax.
  ///   kCurrent: every call scales by its operand's own amax (the same formula).
  /// ```
  /// kHybrid: e4m3 for the forward's operands, e5m2 for gradients (TE's
  /// HYBRID); kE4M3: e4m3 for all three.
  /// min_gemm_intensity: which qualifying GEMMs run in float8, the others in
  /// bfloat16 - those doing at least this many multiply-adds per element
  /// they quantize, M*K*N / (M*K + K*N + M*N) for M rows (tokens), K inputs
  /// and N outputs. Below it, a pass over each of the three operands costs
  /// more than float8's faster GEMMs save. Unset: 3000 on CUDA, calibrated on
  /// an H200 (BENCHMARKS.md: a Linear layer's training step at 8192 tokens
  /// took 0.83x bfloat16's speed at 4096 x 16384, intensity 2341, and 1.03x
  /// at 8192 x 28672, 3574; GPT-2-small's largest is 692), and 0 elsewhere
  /// (float8 on a CPU checks numerics; it is never faster there). 0: every
  /// qualifying GEMM whose shapes fit. amp::fp8_choices() (telemetry.h)
  /// says which layers ran in float8 and why.
  /// Errors (at initialize): amax_history_len < 1, margin < 0,
  /// min_gemm_intensity negative or not finite.
  struct Fp8Scaling {
    /// How the scales are computed: kDelayed (from the amax history) or
    /// kCurrent (from each call's own amax), as above.
    enum class Recipe : uint8_t { kDelayed, kCurrent };
    /// The float8 formats: kHybrid (e4m3 forward, e5m2 gradients) or kE4M3.
    enum class Format : uint8_t { kHybrid, kE4M3 };
    /// The amax kDelayed takes from the history: kMax (its largest) or
    /// kMostRecent (its latest entry).
    enum class Amax : uint8_t { kMax, kMostRecent };
    Recipe recipe = Recipe::kDelayed;  ///< how the scales are computed
    Format format = Format::kHybrid;  ///< the float8 formats of the operands
    int64_t amax_history_len = 16;  ///< the iterations of amax each scale's history keeps (kDelayed)
    Amax amax_compute = Amax::kMax;  ///< which amax of the history kDelayed scales by
    int margin = 0;  ///< scale = fp8_max / amax / 2^margin
    std::optional<double> min_gemm_intensity;  ///< which qualifying GEMMs run in float8 (above)
  };
  Fp8Scaling fp8_scaling;  ///< how the fp8 property's GEMMs scale their operands
};

}  // namespace amp
