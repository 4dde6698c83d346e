#include "common/server_limits.h"

#include <arpa/inet.h>
#include <grpcpp/generic/async_generic_service.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "grpc/support/log.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

TEST(ServerLimitsOptionsTest, DefaultsAreValid) {
  EXPECT_TRUE(ServerLimitsOptions().Validate().ok());
}

TEST(ServerLimitsOptionsTest, ErrorsNameTheOptionWithItsPrefix) {
  struct Case {
    void (*set)(ServerLimitsOptions&);
    const char* name;
  };
  const Case cases[] = {
      {[](ServerLimitsOptions& o) { o.handshake_timeout_ms = 50; }, "grpc_handshake_timeout_ms"},
      {[](ServerLimitsOptions& o) { o.handshake_timeout_ms = 120'001; },
       "grpc_handshake_timeout_ms"},
      {[](ServerLimitsOptions& o) { o.keepalive_time_ms = 999; }, "grpc_keepalive_time_ms"},
      {[](ServerLimitsOptions& o) { o.keepalive_timeout_ms = 99; }, "grpc_keepalive_timeout_ms"},
      {[](ServerLimitsOptions& o) { o.max_concurrent_streams = 0; }, "grpc_max_concurrent_streams"},
      {[](ServerLimitsOptions& o) { o.memory_bytes = 1 << 20; }, "grpc_memory_bytes"},
      {[](ServerLimitsOptions& o) { o.max_threads = 1; }, "grpc_max_threads"},
      {[](ServerLimitsOptions& o) { o.max_connections = 0; }, "grpc_max_connections"},
      {[](ServerLimitsOptions& o) { o.max_connections_per_peer = 0; },
       "grpc_max_connections_per_peer"},
      {[](ServerLimitsOptions& o) { o.fd_reserve = 10; }, "grpc_fd_reserve"},
  };
  for (const Case& c : cases) {
    ServerLimitsOptions o;
    c.set(o);
    absl::Status s = o.Validate("grpc_");
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << c.name;
    EXPECT_THAT(s.message(), HasSubstr(c.name));
  }
}

TEST(ServerLimitsTest, GrpcLogLinesOverTheRateAreCountedNotWritten) {
  grpc_init();  // reads GRPC_VERBOSITY; gpr_log prints nothing before
  RateLimitGrpcLog(5);
  const uint64_t before = SuppressedGrpcLogLines();
  for (int i = 0; i < 50; ++i) gpr_log(GPR_ERROR, "line %d of a flood", i);
  // At most 5 a second get through; the test runs well within two seconds.
  EXPECT_GE(SuppressedGrpcLogLines() - before, 40u);
  grpc_shutdown();
}

TEST(ServerLimitsTest, RaiseFileLimitReachesTheHardLimit) {
  const uint64_t soft = RaiseFileLimit();
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  EXPECT_EQ(limit.rlim_cur, limit.rlim_max);
  EXPECT_EQ(soft, limit.rlim_cur == RLIM_INFINITY ? uint64_t{1} << 20 : limit.rlim_cur);
}

TEST(ServerLimitsTest, TotalCapIsTheFdLimitLessTheReserve) {
  ServerLimitsOptions o;
  o.max_connections = 100'000;
  o.fd_reserve = 1'000;
  EXPECT_EQ(InstallAcceptGuard(o, 5'000), 4'000u);
  o.max_connections = 10;
  EXPECT_EQ(InstallAcceptGuard(o, 5'000), 10u);
  InstallAcceptGuard(ServerLimitsOptions(), RaiseFileLimit());
}

int ConnectTo(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// Whether the server closed `fd` within `ms` (the guard closes refused ones at once); what
// the server sent before (its HTTP/2 SETTINGS) is read and dropped.
bool ClosedWithin(int fd, int ms) {
  const absl::Time deadline = absl::Now() + absl::Milliseconds(ms);
  char buf[256];
  while (true) {
    const int left = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, left) <= 0) return false;
    const ssize_t got = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno == ECONNRESET)) return true;
  }
}

// The guard stands between libgrpc's listener and the kernel: a real gRPC server refuses
// connections over max_connections_per_peer at once, and its idle ones within the handshake
// timeout.
TEST(ServerLimitsTest, GrpcServerClosesConnectionsOverThePeerCapAtOnce) {
  ASSERT_TRUE(GetAcceptGuardCounters().interposed)
      << "libgrpc's accept4 does not reach the guard (is accept4 exported?)";
  ServerLimitsOptions o;
  o.max_connections_per_peer = 3;
  o.handshake_timeout_ms = 1'000;
  InstallAcceptGuard(o, RaiseFileLimit());
  grpc::CallbackGenericService generic;
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(&generic);
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  ApplyServerLimits(o, &builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const AcceptGuardCounters before = GetAcceptGuardCounters();

  std::vector<int> fds;
  for (int i = 0; i < 6; ++i) fds.push_back(ConnectTo(port));
  int closed_at_once = 0;
  for (int fd : fds) closed_at_once += ClosedWithin(fd, 300) ? 1 : 0;
  EXPECT_EQ(closed_at_once, 3);
  const AcceptGuardCounters after = GetAcceptGuardCounters();
  EXPECT_EQ(after.refused_peer_cap - before.refused_peer_cap, 3u);
  EXPECT_EQ(after.accepted - before.accepted, 3u);
  // The three admitted ones send nothing: the handshake timeout closes them.
  int closed_later = 0;
  for (int fd : fds) closed_later += ClosedWithin(fd, 3'000) ? 1 : 0;
  EXPECT_EQ(closed_later, 6);
  for (int fd : fds) close(fd);

  // Room again (after the guard's prune interval): a new connection is admitted.
  usleep(100'000);
  const int fd = ConnectTo(port);
  EXPECT_FALSE(ClosedWithin(fd, 300));
  close(fd);
  server->Shutdown();
  InstallAcceptGuard(ServerLimitsOptions(), RaiseFileLimit());
}

}  // namespace
}  // namespace kvcm
