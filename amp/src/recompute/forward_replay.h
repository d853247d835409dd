// SPDX-License-Identifier: BSD-3-Clause
// Private: what a recomputed block's forward ran with, taken when it ran and
// given back to the rerun in backward (recompute.h).
//
// The autograd engine runs the rerun inside backward, on whichever thread
// backward uses, where amp's kernels would not cast (scale_loss disables
// casts, and amp never casts in backward), the cast cache may already hold
// other copies, and the random generators have moved on. ForwardReplay
// records, at forward:
//   - the thread's dispatch-key state (whether amp's autocast keys are
//     included or excluded: initialize, enable_casts, disable_casts,
//     custom_fwd) and LibTorch's per-device autocast dtypes and cache switch
//     (cast_dtype, disable_cast_cache);
//   - the state of the CPU generator and of each CUDA device's generator
//     among the block's inputs;
//   - the cast cache's copies of weights, served to the rerun as leaves of
//     their own (see block_boundary.h), so the rerun meets the very casts
//     forward made;
//   - the buffers the block updated in place: those whose version counter
//     moved, and a BatchNorm's (or InstanceNorm's) running statistics when
//     its num_batches_tracked moved (the kernel updates them without
//     moving their counters).
// Replay, for the extent of the rerun, sets all of it (and interception's
// "recomputing" mark: casts as in forward, no op statistics), then gives
// the thread and generators back what they held and the updated buffers
// their values from before the rerun - written through their data, so the
// counters the rerun's graph saved stay valid.
#pragma once

#include "interception/cast_cache.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace amp::detail {

class ForwardReplay {
  struct GeneratorState {
    at::Generator generator;
    at::Tensor state;
  };

 public:
  // Takes the thread's state and the generators' states now (before the
  // block's forward runs), and the devices of `inputs`.
  explicit ForwardReplay(const std::vector<at::Tensor>& inputs);

  // After the forward: which of `buffers` it updated, from their version
  // counters before it (`versions`, same order); the rerun puts them back.
  void keep_updated_buffers(const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                            const std::vector<int64_t>& versions);
  // After the forward: the cast cache's copies, for the rerun.
  void keep_cached_copies(std::vector<CachedCopy> copies) { copies_ = std::move(copies); }
  const std::vector<CachedCopy>& cached_copies() const { return copies_; }

  // RAII: the rerun's thread and generator state (see above). `proxies`:
  // what the cast cache serves instead of each of cached_copies().
  class [[nodiscard]] Scope {
   public:
    Scope(const ForwardReplay& replay, const std::vector<at::Tensor>& proxies);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    c10::impl::ForceDispatchKeyGuard keys_;
    c10::ScalarType cpu_dtype_, cuda_dtype_;
    bool cache_enabled_;
    std::vector<GeneratorState> generators_;  // their states before the rerun
    std::vector<at::Tensor> buffer_values_;   // the updated buffers' values before the rerun
    const ForwardReplay& replay_;
    std::optional<ServeCopies> serve_;
  };

 private:
  c10::impl::LocalDispatchKeySet keys_;
  c10::ScalarType cpu_dtype_, cuda_dtype_;
  bool cache_enabled_;
  std::vector<GeneratorState> generators_;
  std::vector<at::Tensor> updated_buffers_;
  std::vector<CachedCopy> copies_;
};

}  // namespace amp::detail
