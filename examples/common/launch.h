// SPDX-License-Identifier: BSD-3-Clause
// Joining a job as launchers start it: torchrun (also on several nodes, and
// its restarts), Slurm's srun, or explicit flags - the recipe docs/guide.md,
// "Beyond one machine", shows. A rendezvous over a TCPStore at
// MASTER_ADDR:MASTER_PORT, then a c10d group: Gloo for CPU tensors, NCCL for
// CUDA ones (one GPU a process: the local rank's).
#pragma once

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <optional>
#include <string>

namespace examples {

// Where this process stands in the job.
struct Launch {
  std::string launcher;  // "torchrun", "slurm" or "flags"
  int rank = 0, world_size = 1;
  int local_rank = 0;  // on this node: which GPU is this process's
  std::string master_addr;
  int master_port = 0;
  // torchrun's agent hosts the store: every worker connects as a client.
  bool agent_store = false;
  // torchrun's restarts so far: each attempt meets under a key prefix of
  // its own, away from the keys a failed attempt left in the agent's store.
  int restart_count = 0;
};

// The launcher's variables, read through `getenv`: torchrun's (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*) or
// Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR, else the
// first node of SLURM_JOB_NODELIST; MASTER_PORT, else 29500 + the job id
// modulo 10000). nullopt when no launcher started this process. Throws
// std::invalid_argument naming the variable that is missing or malformed.
std::optional<Launch> launch_from_environment(
    const std::function<const char*(const char*)>& getenv = [](const char* name) { return std::getenv(name); });

// The first host of a Slurm node list: "gpu[03-05,07],cpu1" -> "gpu03".
std::string first_slurm_node(const std::string& nodelist);

struct Connection {
  c10::intrusive_ptr<c10d::Store> store;  // the job's store, under this attempt's prefix
  c10::intrusive_ptr<c10d::Backend> group;
};

// Meets the other ranks at launch.master_addr:master_port (rank 0 hosts the
// TCPStore unless torchrun's agent does) and makes the group: Gloo over this
// host's interface for a CPU `device`, NCCL for a CUDA one (the caller sets
// the current device to the local rank's first). Every wait ends at
// `timeout` with LibTorch's error. The process ignores SIGPIPE from then
// on, as Python does: a write to a lost rank's socket fails, not kills.
Connection connect(const Launch& launch, c10::Device device, std::chrono::milliseconds timeout, int gloo_threads);

}  // namespace examples
