// SPDX-License-Identifier: BSD-3-Clause
// Private: the ranks meet before a forward starts the weights' all-gather.
//
// After LibTorch's own step the sharded weights are all-gathered in the next
// forward (sharded_optimizer.h). A forward that runs on one rank alone
// (rank 0 evaluates while the others wait at a barrier) would start a
// collective the others never join: it would wait, and the collective left in
// flight would pair with their next one (the barrier), breaking the group for
// good. So first the ranks meet through the process group's store - no
// collective: each rank arrives, the last to arrive lets them all start, and
// a rank that waits longer than its timeout calls the round off and starts
// nothing; amp raises its error there, the group stays usable, and a rank
// that reaches a round called off goes on to the next one, where the ranks
// meet at their next forward.
//
// The store: DataParallel::store, or the one a ProcessGroupGloo was made
// with. Without one (ProcessGroupNCCL keeps its own private) the ranks meet
// in the collective itself, and a lone forward's error leaves it in flight.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace amp::detail {

class GatherRendezvous {
 public:
  // `store` may be null: then the group's own (Gloo), if amp can reach it.
  // `name` tells this rendezvous from others on the same store (every rank
  // gives the same one).
  GatherRendezvous(const c10::intrusive_ptr<c10d::Backend>& group, c10::intrusive_ptr<c10d::Store> store,
                   std::string name);

  bool available() const { return store_.defined(); }
  // Arrives at the next round and waits for every rank. True: all came (the
  // gather may start). False: `timeout` passed first and this rank called
  // the round off (nothing starts; the next call meets at a new round).
  bool meet(std::chrono::milliseconds timeout);

 private:
  std::string key(uint64_t round, const char* what) const;

  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int world_;
  uint64_t round_ = 0;
};

// How long a rank waits for the others at a gather: DataParallel's
// gather_timeout, and at most half the group's own timeout (so that ranks
// waiting for this one in their own collective - a barrier - do not time
// out first). `group_timeout` is set to the group's (zero if it has none).
std::chrono::milliseconds gather_wait(std::chrono::milliseconds gather_timeout,
                                      const c10::intrusive_ptr<c10d::Backend>& group,
                                      std::chrono::milliseconds* group_timeout);

}  // namespace amp::detail
