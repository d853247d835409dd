// SPDX-License-Identifier: BSD-3-Clause
// Private: which of a sharded optimizer's gathers hold whole weights, and
// until when (DataParallel::shard_weights, ZeRO stage 3).
//
// Each rank keeps its pieces; a gather's members (the module's parameters)
// hold bytes only from the gather that fills them until the run that owns
// them ends:
//
//   read by                                 whole until
//   --------------------------------------  -------------------------------
//   a recomputed block's forward            the block's forward ends
//   its rerun in backward                   the rerun's backward ends
//   an op outside recomputed blocks         the round ends (its guard)
//
// A gather a run reads that an enclosing run (or the round) already holds
// stays with the outer one. A block's forward records the gathers it read,
// so its rerun can start them all before its first op, and the rerun of the
// block before it (the next one backward reaches) can start travelling
// while it runs - where that block began inside the same run as this one:
// nested blocks (a run of blocks recomputed around them) run their forward
// again inside their run's rerun, as new blocks, and the earlier forward's
// are never rerun.
//
// Bookkeeping only: sharded_optimizer.cpp starts, takes and frees.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace amp::detail {

class WeightResidency {
 public:
  static constexpr size_t kForward = std::numeric_limits<size_t>::max();

  explicit WeightResidency(size_t gathers = 0) : owner_(gathers, kFreed) {}

  bool whole(size_t g) const { return owner_[g] != kFreed; }
  bool all_whole() const { return wholes_ == owner_.size(); }
  // Gather g was taken into its members (it was not whole).
  void take(size_t g);
  // An op reads gather g, whole.
  void read(size_t g);
  // The gathers the innermost run owns, now freed (its end).
  std::vector<size_t> end_run();
  // Every gather freed: the round is over (the gathers of its blocks are forgotten).
  void end_round();

  // A recomputed block's run begins: its forward (returns a new id), or the
  // rerun of block `rerun_of` (returns it).
  size_t begin_run(size_t rerun_of = kForward);
  bool rerunning() const { return !runs_.empty() && runs_.back().rerun; }
  // Inside a rerun, at any depth: backward, where forward order does not
  // say what is read next (a run's rerun runs its blocks' forwards again).
  bool in_rerun() const;
  // The gathers block `id`'s forward read, in order (none for a block of an
  // earlier round).
  const std::vector<size_t>& read_by(size_t id) const;
  // Whether blocks a and b of this round began inside the same run (the
  // same forward or rerun of it), or both outside any.
  bool siblings(size_t a, size_t b) const;

 private:
  static constexpr size_t kFreed = std::numeric_limits<size_t>::max();
  struct Run {
    size_t id;
    bool rerun;
  };
  // A block of this round.
  struct Block {
    std::vector<size_t> read;  // the gathers its forward read, in order
    Run parent;                // the run it began in ({kFreed}: none)
  };

  size_t depth() const { return runs_.size(); }  // 0: outside recomputed blocks
  const Block* block(size_t id) const;           // null: a block of an earlier round

  std::vector<size_t> owner_;  // per gather: kFreed, or the depth of the run holding it
  size_t wholes_ = 0;
  std::vector<Run> runs_;      // running, innermost last
  std::vector<Block> blocks_;  // this round's, from id first_id_ on
  size_t first_id_ = 0;
};

}  // namespace amp::detail
