// SPDX-License-Identifier: BSD-3-Clause
// The examples' launcher recipe (examples/common/launch.h) reads what
// torchrun and Slurm set, and says which variable is missing or malformed.
// The launches themselves run as ctests (tests/launch/): torchrun on two
// "nodes" on loopback, a lost rank and the restart that resumes.
#include "test_util.h"

#include "common/launch.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <map>

namespace amp::testing {
namespace {

using Environment = std::map<std::string, std::string>;

std::optional<examples::Launch> launch_in(const Environment& environment) {
  return examples::launch_from_environment([&](const char* name) -> const char* {
    auto it = environment.find(name);
    return it == environment.end() ? nullptr : it->second.c_str();
  });
}

TEST(LaunchTest, NoLauncherMeansNone) { EXPECT_FALSE(launch_in({{"HOME", "/root"}}).has_value()); }

TEST(LaunchTest, TorchrunsVariablesAndItsAgentsStore) {
  const auto launch = launch_in({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "node0"},
                                 {"MASTER_PORT", "29400"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                 {"TORCHELASTIC_RESTART_COUNT", "1"}, {"TORCHELASTIC_RUN_ID", "job"}});
  ASSERT_TRUE(launch.has_value());
  EXPECT_EQ(launch->launcher, "torchrun");
  EXPECT_EQ(launch->rank, 5);
  EXPECT_EQ(launch->world_size, 8);
  EXPECT_EQ(launch->local_rank, 1);
  EXPECT_EQ(launch->master_addr, "node0");
  EXPECT_EQ(launch->master_port, 29400);
  EXPECT_TRUE(launch->agent_store);
  EXPECT_EQ(launch->restart_count, 1);
}

TEST(LaunchTest, SlurmsVariablesWithTheFirstNodeAsTheMaster) {
  const auto launch = launch_in({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                                 {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"SLURM_JOB_ID", "123456"}});
  ASSERT_TRUE(launch.has_value());
  EXPECT_EQ(launch->launcher, "slurm");
  EXPECT_EQ(launch->rank, 3);
  EXPECT_EQ(launch->world_size, 4);
  EXPECT_EQ(launch->local_rank, 1);
  EXPECT_EQ(launch->master_addr, "gpu07");
  EXPECT_EQ(launch->master_port, 29500 + 123456 % 10000);
  EXPECT_FALSE(launch->agent_store);
  // MASTER_ADDR and MASTER_PORT, where the batch script sets them, win.
  const auto set = launch_in({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                              {"SLURM_JOB_NODELIST", "a,b"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "12345"}});
  EXPECT_EQ(set->master_addr, "10.0.0.1");
  EXPECT_EQ(set->master_port, 12345);
}

TEST(LaunchTest, SlurmNodeListsGiveTheirFirstHost) {
  EXPECT_EQ(examples::first_slurm_node("node17"), "node17");
  EXPECT_EQ(examples::first_slurm_node("gpu[03-05,07],cpu1"), "gpu03");
  EXPECT_EQ(examples::first_slurm_node("rack1-n[1,4]"), "rack1-n1");
  EXPECT_EQ(examples::first_slurm_node("a,b,c"), "a");
}

TEST(LaunchTest, AMissingOrMalformedVariableIsNamed) {
  auto error_of = [](const Environment& environment) {
    try {
      launch_in(environment);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error_of({{"RANK", "0"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}),
              ::testing::HasSubstr("WORLD_SIZE is not set"));
  EXPECT_THAT(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), ::testing::HasSubstr("RANK='x' is not a non-negative integer"));
  EXPECT_THAT(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}),
              ::testing::HasSubstr("rank 2 is outside world size 2"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_PORT", "1"}}),
              ::testing::HasSubstr("no MASTER_ADDR"));
  EXPECT_THAT(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}),
              ::testing::HasSubstr("MASTER_PORT 70000 is not a TCP port"));
}

// A port nothing listens on now (the kernel's pick for port 0).
int unused_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), length), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  ::close(fd);
  return ntohs(address.sin_port);
}

// A rank that outlives a peer writes to the peer's closed socket: with
// SIGPIPE's default the survivor would end there, silently, instead of
// naming the lost rank (tests/launch/lost_rank.sh, docs/guide.md).
TEST(LaunchTest, AConnectedRankIgnoresSigpipe) {
  std::signal(SIGPIPE, SIG_DFL);
  const examples::Launch launch{"flags", 0, 1, 0, "127.0.0.1", unused_port()};
  const examples::Connection connection = examples::connect(launch, c10::kCPU, std::chrono::seconds(30), 1);
  struct sigaction action {};
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &action), 0);
  ASSERT_EQ(action.sa_handler, SIG_IGN);  // (else the write below would end the suite)
  // What that buys: a write to a closed pipe fails with EPIPE.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ::close(fds[0]);
  EXPECT_EQ(::write(fds[1], "x", 1), -1);
  EXPECT_EQ(errno, EPIPE);
  ::close(fds[1]);
}

}  // namespace
}  // namespace amp::testing
