// SPDX-License-Identifier: BSD-3-Clause
#include "common/launch.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef AMP_EXAMPLES_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <csignal>
#include <cstdlib>
#include <regex>
#include <stdexcept>

namespace examples {
namespace {

using Getenv = std::function<const char*(const char*)>;

// The integer in variable `name`, which must be set (launcher says who sets it).
int integer(const Getenv& getenv, const char* name, const char* launcher) {
  const char* value = getenv(name);
  if (value == nullptr || *value == '\0') {
    throw std::invalid_argument(std::string(name) + " is not set, though " + launcher +
                                " variables are: was this process started by " + launcher + "?");
  }
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  if (*end != '\0' || parsed < 0 || parsed > (1 << 30)) {
    throw std::invalid_argument(std::string(name) + "='" + value + "' is not a non-negative integer");
  }
  return static_cast<int>(parsed);
}

std::string text(const Getenv& getenv, const char* name, const std::string& otherwise) {
  const char* value = getenv(name);
  return value != nullptr && *value != '\0' ? value : otherwise;
}

void check(const Launch& launch) {
  if (launch.world_size < 1 || launch.rank >= launch.world_size) {
    throw std::invalid_argument(launch.launcher + ": rank " + std::to_string(launch.rank) + " is outside world size " +
                                std::to_string(launch.world_size));
  }
  if (launch.master_addr.empty()) throw std::invalid_argument(launch.launcher + ": no MASTER_ADDR");
  if (launch.master_port < 1 || launch.master_port > 65535) {
    throw std::invalid_argument(launch.launcher + ": MASTER_PORT " + std::to_string(launch.master_port) +
                                " is not a TCP port");
  }
}

}  // namespace

std::string first_slurm_node(const std::string& nodelist) {
  // The first entry: a name, or a prefix with a bracketed range list.
  static const std::regex first(R"(^([^,\[]+)(?:\[([^,\]-]+)[^\]]*\])?)");
  std::smatch m;
  if (!std::regex_search(nodelist, m, first)) throw std::invalid_argument("cannot read SLURM_JOB_NODELIST '" + nodelist + "'");
  return m[1].str() + m[2].str();
}

std::optional<Launch> launch_from_environment(const Getenv& getenv) {
  Launch launch;
  if (getenv("RANK") != nullptr || getenv("TORCHELASTIC_RUN_ID") != nullptr) {
    launch.launcher = "torchrun";
    launch.rank = integer(getenv, "RANK", "torchrun");
    launch.world_size = integer(getenv, "WORLD_SIZE", "torchrun");
    launch.local_rank = integer(getenv, "LOCAL_RANK", "torchrun");
    launch.master_addr = text(getenv, "MASTER_ADDR", "");
    launch.master_port = integer(getenv, "MASTER_PORT", "torchrun");
    launch.agent_store = text(getenv, "TORCHELASTIC_USE_AGENT_STORE", "") == "True";
    if (getenv("TORCHELASTIC_RESTART_COUNT") != nullptr) {
      launch.restart_count = integer(getenv, "TORCHELASTIC_RESTART_COUNT", "torchrun");
    }
  } else if (getenv("SLURM_PROCID") != nullptr) {
    launch.launcher = "slurm";
    launch.rank = integer(getenv, "SLURM_PROCID", "Slurm");
    launch.world_size = integer(getenv, "SLURM_NTASKS", "Slurm");
    launch.local_rank = integer(getenv, "SLURM_LOCALID", "Slurm");
    const std::string nodes = text(getenv, "SLURM_JOB_NODELIST", text(getenv, "SLURM_NODELIST", ""));
    launch.master_addr = text(getenv, "MASTER_ADDR", nodes.empty() ? "" : first_slurm_node(nodes));
    launch.master_port = getenv("MASTER_PORT") != nullptr ? integer(getenv, "MASTER_PORT", "Slurm")
                         : getenv("SLURM_JOB_ID") != nullptr ? 29500 + integer(getenv, "SLURM_JOB_ID", "Slurm") % 10000
                                                               : 29500;
  } else {
    return std::nullopt;
  }
  check(launch);
  return launch;
}

Connection connect(const Launch& launch, c10::Device device, std::chrono::milliseconds timeout, int gloo_threads) {
  check(launch);
  // A rank that dies closes its sockets, and a survivor's next write to one
  // raises SIGPIPE, whose default ends the process with nothing said. As in
  // Python (torchrun's Python ranks), the write fails instead (EPIPE): the
  // collective throws, and the survivor names the lost rank.
  std::signal(SIGPIPE, SIG_IGN);
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(launch.master_port);
  options.isServer = launch.rank == 0 && !launch.agent_store;
  options.numWorkers = launch.world_size;
  options.waitWorkers = false;
  options.timeout = timeout;
  auto tcp = c10::make_intrusive<c10d::TCPStore>(launch.master_addr, options);
  // As torch.distributed does under torchrun: one prefix per attempt.
  Connection connection;
  connection.store = c10::make_intrusive<c10d::PrefixStore>(
      "/worker/attempt_" + std::to_string(launch.restart_count), tcp);
  if (device.is_cuda()) {
#ifdef AMP_EXAMPLES_WITH_NCCL
    c10::cuda::set_device(device.index());  // NCCL's communicator binds to the current device
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL::Options>();
    nccl->timeout = timeout;
    connection.group = c10::make_intrusive<c10d::ProcessGroupNCCL>(connection.store, launch.rank,
                                                                   launch.world_size, nccl);
    return connection;
#else
    throw std::invalid_argument("this build of the examples has no NCCL (nccl.h was not found at configure time)");
#endif
  }
  auto gloo = c10d::ProcessGroupGloo::Options::create();
  gloo->timeout = timeout;
  gloo->threads = gloo_threads;
  // The interface Gloo's pairs connect over: GLOO_SOCKET_IFNAME's, loopback
  // for a job on one host, else the one this host's name resolves to.
  if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME"); interface != nullptr && *interface != '\0') {
    gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
  } else if (launch.master_addr == "localhost" || launch.master_addr.rfind("127.", 0) == 0) {
    gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    gloo->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  connection.group = c10::make_intrusive<c10d::ProcessGroupGloo>(connection.store, launch.rank, launch.world_size, gloo);
  return connection;
}

}  // namespace examples
