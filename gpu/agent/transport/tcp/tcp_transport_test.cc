#include "gpu/agent/transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/internal/endian.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gpu/agent/transport/data_socket.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.pb.h"
#include "tests/util/agent_pools.h"
#include "tests/util/connection_flood.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kBlocks = 16;
constexpr uint64_t kEpoch = 3;
const NamespaceId kNs{"acme", "small"};

PageHash Page(uint64_t i) { return PageHash{i + 1, ~i}; }

// Waits for one pull's outcome.
class Outcome {
 public:
  PullDone Done() {
    return [this](absl::StatusOr<TransferStats> r) {
      result_ = std::move(r);
      done_.Notify();
    };
  }
  absl::StatusOr<TransferStats> Wait() {
    EXPECT_TRUE(done_.WaitForNotificationWithTimeout(absl::Seconds(30)));
    return result_.value_or(absl::InternalError("no outcome"));
  }

 private:
  absl::Notification done_;
  std::optional<absl::StatusOr<TransferStats>> result_;
};

// Agent A's pool with committed pages and a transport serving it; agent B's pool and a
// transport pulling into it.
class TcpTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = MakeHostPool(SmallGqa(), kBlocks);
    b_ = MakeHostPool(SmallGqa(), kBlocks);
    block_bytes_ = a_->geometry().bytes_per_block();
    absl::StatusOr<std::unique_ptr<Transport>> ta =
        MakeTcpTransport({}, AgentPools{.main = a_.get()}, Tier::kGpu);
    ASSERT_TRUE(ta.ok()) << ta.status();
    ta_ = *std::move(ta);
    absl::StatusOr<std::unique_ptr<Transport>> tb =
        MakeTcpTransport({.io_timeout_ms = 500}, AgentPools{.main = b_.get()}, Tier::kGpu);
    ASSERT_TRUE(tb.ok()) << tb.status();
    tb_ = *std::move(tb);
  }

  // Commits `n` pages with random bytes in A; returns their blocks.
  std::vector<BlockId> CommitInA(uint32_t n, uint64_t first_page = 0) {
    std::vector<BlockId> ids = *a_->Allocate(n, kEpoch, &kNs);
    std::vector<std::byte> bytes(n * block_bytes_);
    std::mt19937 rng(static_cast<uint32_t>(first_page + 7));
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
    EXPECT_TRUE(a_->WriteBlocks(ids, kEpoch, bytes).ok());
    std::vector<CommitEntry> entries;
    for (uint32_t i = 0; i < n; ++i) {
      entries.push_back({.block = ids[i],
                         .page = Page(first_page + i),
                         .parent = first_page + i == 0 ? PageHash{} : Page(first_page + i - 1)});
    }
    EXPECT_TRUE(a_->Commit(kNs, kEpoch, entries, "block_ids").ok());
    return ids;
  }

  std::vector<std::byte> Bytes(BlockPool& pool, BlockId id) {
    std::vector<std::byte> out(block_bytes_);
    EXPECT_TRUE(pool.ReadBlock(id, kEpoch, 0, out).ok());
    return out;
  }

  PullSpec Spec(const std::vector<BlockId>& from, uint64_t first_page,
                const std::vector<BlockId>& into) {
    PullSpec spec{.peer_address = ta_->address(),
                  .peer_tier = Tier::kGpu,
                  .ns = kNs,
                  .peer_blocks = from,
                  .dst = b_.get(),
                  .dst_blocks = into,
                  .dst_owner_epoch = kEpoch};
    for (size_t i = 0; i < from.size(); ++i) spec.pages.push_back(Page(first_page + i));
    return spec;
  }

  std::unique_ptr<BlockPool> a_, b_;
  uint64_t block_bytes_ = 0;
  std::unique_ptr<Transport> ta_, tb_;
};

TEST_F(TcpTransportTest, APullCopiesCommittedBlocksBitForBit) {
  const std::vector<BlockId> from = CommitInA(5);
  const std::vector<BlockId> into = *b_->Allocate(5, kEpoch, &kNs);
  Outcome out;
  tb_->Pull(Spec(from, 0, into), out.Done());
  absl::StatusOr<TransferStats> r = out.Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes, 5 * block_bytes_);
  for (size_t i = 0; i < from.size(); ++i) {
    EXPECT_EQ(Bytes(*b_, into[i]), Bytes(*a_, from[i])) << "block " << i;
  }
  // The transport commits nothing: B's blocks are still only allocated.
  EXPECT_EQ(b_->Stats().committed_blocks, 0u);
}

TEST_F(TcpTransportTest, ABlockThatNoLongerHoldsItsPageFailsThePull) {
  const std::vector<BlockId> from = CommitInA(3);
  const std::vector<BlockId> into = *b_->Allocate(3, kEpoch, &kNs);
  // Block 1 was evicted and freed on A since the puller matched it.
  ASSERT_TRUE(a_->FreeCommitted({&from[1], 1}, kEpoch, "free").ok());
  Outcome out;
  tb_->Pull(Spec(from, 0, into), out.Done());
  absl::StatusOr<TransferStats> r = out.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("block_ids[1]"));

  // Another page of the namespace asked for in a committed block: refused too.
  Outcome wrong;
  PullSpec spec = Spec({from[0]}, 9, {into[0]});
  tb_->Pull(spec, wrong.Done());
  EXPECT_EQ(wrong.Wait().status().code(), absl::StatusCode::kFailedPrecondition);
  // ... and so is another tenant asking for the same page hash.
  Outcome tenant;
  spec = Spec({from[0]}, 0, {into[0]});
  spec.ns = NamespaceId{"other", "small"};
  tb_->Pull(spec, tenant.Done());
  EXPECT_EQ(tenant.Wait().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(TcpTransportTest, BadSpecsAndUnreachablePeersAreErrors) {
  const std::vector<BlockId> from = CommitInA(2);
  const std::vector<BlockId> into = *b_->Allocate(2, kEpoch, &kNs);
  Outcome uneven;
  tb_->Pull(Spec(from, 0, {into[0]}), uneven.Done());
  EXPECT_EQ(uneven.Wait().status().code(), absl::StatusCode::kInvalidArgument);

  Outcome host;  // A has no host pool
  PullSpec spec = Spec(from, 0, into);
  spec.peer_tier = Tier::kHost;
  tb_->Pull(spec, host.Done());
  absl::StatusOr<TransferStats> r = host.Wait();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("not a pool of this agent"));

  Outcome wraps;  // a value no Tier names
  spec = Spec(from, 0, into);
  spec.peer_tier = static_cast<Tier>(4);
  tb_->Pull(spec, wraps.Done());
  EXPECT_EQ(wraps.Wait().status().code(), absl::StatusCode::kInvalidArgument);

  Outcome nobody;
  spec = Spec(from, 0, into);
  spec.peer_address = "127.0.0.1:1";
  tb_->Pull(spec, nobody.Done());
  EXPECT_EQ(nobody.Wait().status().code(), absl::StatusCode::kUnavailable);

  EXPECT_EQ(
      MakeTcpTransport({.listen_address = "localhost:1"}, AgentPools{.main = a_.get()}, Tier::kGpu)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
}

// A peer that answers a valid header, then `behaviour`: half a block and close, or silence.
class FakePeer {
 public:
  enum class Behaviour { kCloseMidBlock, kGoSilent };
  FakePeer(Behaviour behaviour, uint64_t block_bytes) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(fd_, 1), 0);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this, behaviour, block_bytes] {
      const int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      char buf[4096];
      (void)recv(c, buf, sizeof(buf), 0);  // the request
      v1::PullBlocksHeader h;
      h.set_bytes_per_block(block_bytes);
      const std::string body = h.SerializeAsString();
      char len4[4];
      absl::little_endian::Store32(len4, static_cast<uint32_t>(body.size()));
      (void)send(c, len4, 4, 0);
      (void)send(c, body.data(), body.size(), 0);
      const char tag = 1;
      (void)send(c, &tag, 1, 0);
      std::vector<char> half(block_bytes / 2);
      (void)send(c, half.data(), half.size(), 0);
      if (behaviour == Behaviour::kGoSilent) release_.WaitForNotification();
      close(c);
    });
  }
  ~FakePeer() {
    release_.Notify();
    shutdown(fd_, SHUT_RDWR);
    thread_.join();
    close(fd_);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
  absl::Notification release_;
  std::thread thread_;
};

TEST_F(TcpTransportTest, APeerThatDiesOrGoesSilentMidBlockFailsThePull) {
  const std::vector<BlockId> into = *b_->Allocate(1, kEpoch, &kNs);
  for (FakePeer::Behaviour b :
       {FakePeer::Behaviour::kCloseMidBlock, FakePeer::Behaviour::kGoSilent}) {
    FakePeer peer(b, block_bytes_);
    PullSpec spec = Spec({0}, 0, into);
    spec.peer_address = peer.address();
    Outcome out;
    tb_->Pull(spec, out.Done());
    const absl::StatusCode want = b == FakePeer::Behaviour::kCloseMidBlock
                                      ? absl::StatusCode::kUnavailable
                                      : absl::StatusCode::kDeadlineExceeded;  // 500 ms timeout
    EXPECT_EQ(out.Wait().status().code(), want);
  }
  // The destination block is still B's, allocated, never committed.
  EXPECT_TRUE(b_->CheckOwned(into, kEpoch, "into").ok());
  EXPECT_EQ(b_->Stats().committed_blocks, 0u);
}

TEST_F(TcpTransportTest, ConcurrentPullsAndShutdownWithPullsInFlight) {
  const std::vector<BlockId> from = CommitInA(8);
  std::vector<Outcome> outs(8);
  std::vector<BlockId> into = *b_->Allocate(8, kEpoch, &kNs);
  for (size_t i = 0; i < 8; ++i) tb_->Pull(Spec({from[i]}, i, {into[i]}), outs[i].Done());
  for (size_t i = 0; i < 8; ++i) {
    ASSERT_TRUE(outs[i].Wait().ok()) << i;
    EXPECT_EQ(Bytes(*b_, into[i]), Bytes(*a_, from[i]));
  }
  // Destroying a transport with a pull in flight completes the pull (with an error, or
  // with its bytes if it won the race) and joins every thread.
  Outcome late;
  tb_->Pull(Spec(from, 0, into), late.Done());
  tb_.reset();
  (void)late.Wait();
}

}  // namespace
}  // namespace kvcm

namespace kvcm {
namespace {

// A TCP connection to `address` from source address `from` (another loopback address stands
// for another peer); -1 when it fails.
int ConnectFrom(const std::string& from, const std::string& address) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in src{};
  src.sin_family = AF_INET;
  inet_pton(AF_INET, from.c_str(), &src.sin_addr);
  absl::StatusOr<sockaddr_in> dst = ParseAddress(address, "address");
  if (bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0 ||
      connect(fd, reinterpret_cast<const sockaddr*>(&*dst), sizeof(*dst)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the server closed `fd` within `timeout` (anything it sent first is dropped).
bool ClosedWithin(int fd, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  char buf[512];
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (poll(&p, 1, std::max(ms, 1)) <= 0) continue;
    const ssize_t got = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
  return false;
}

// The data-port attack: 16 idle connections took every slot and delayed a pull from
// 51 ms to 9.8 s; one byte every 5 s held them. Now a pull is served at once beside them,
// the ones over the per-address handshake cap are closed as they arrive, and every silent or
// dripping connection is closed at the handshake deadline.
TEST_F(TcpTransportTest, IdleAndDrippingPeersHoldNoSlotAPullNeeds) {
  const std::vector<BlockId> from = CommitInA(4);
  std::vector<int> idle;
  for (int i = 0; i < 16; ++i) {
    idle.push_back(ConnectFrom(i < 8 ? "127.0.0.2" : "127.0.0.3", ta_->address()));
    ASSERT_GE(idle.back(), 0);
  }
  // Over data_max_handshakes_per_peer (8) from 127.0.0.2: closed at once, not queued.
  const int over_cap = ConnectFrom("127.0.0.2", ta_->address());
  ASSERT_GE(over_cap, 0);
  EXPECT_TRUE(ClosedWithin(over_cap, absl::Milliseconds(500)));
  close(over_cap);
  // A peer that sends a request's first bytes one at a time.
  const int dripper = ConnectFrom("127.0.0.4", ta_->address());
  ASSERT_GE(dripper, 0);
  std::atomic<bool> stop_drip{false};
  std::thread drip([&] {
    const char frame[4] = {100, 0, 0, 0};  // a 100-byte frame that never comes
    for (int i = 0; i < 4 && !stop_drip; ++i) {
      (void)send(dripper, &frame[i], 1, MSG_NOSIGNAL);
      absl::SleepFor(absl::Milliseconds(400));
    }
  });

  const absl::Time start = absl::Now();
  const std::vector<BlockId> into = *b_->Allocate(4, kEpoch, &kNs);
  Outcome out;
  tb_->Pull(Spec(from, 0, into), out.Done());
  absl::StatusOr<TransferStats> r = out.Wait();
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LT(took, absl::Milliseconds(500)) << "the pull waited behind idle connections";
  for (size_t i = 0; i < from.size(); ++i) EXPECT_EQ(Bytes(*b_, into[i]), Bytes(*a_, from[i]));

  // The handshake deadline (1 s by default) closes the silent ones and the dripper.
  for (int fd : idle) EXPECT_TRUE(ClosedWithin(fd, absl::Seconds(3)));
  EXPECT_TRUE(ClosedWithin(dripper, absl::Seconds(3)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  stop_drip = true;
  drip.join();
  for (int fd : idle) close(fd);
  close(dripper);
}

TEST(TcpTransportLimitsTest, HandshakesOverTheCapsAreClosedAtOnceOrDisplaceTheOldest) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), kBlocks);
  auto counters = std::make_shared<DataPortCounters>();
  absl::StatusOr<std::unique_ptr<Transport>> t =
      MakeTcpTransport({.max_handshakes = 3,
                        .max_handshakes_per_peer = 3,
                        .handshake_timeout_ms = 300,
                        .counters = counters},
                       AgentPools{.main = pool.get()}, Tier::kGpu);
  ASSERT_TRUE(t.ok()) << t.status();
  std::vector<int> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(ConnectFrom("127.0.0.1", (*t)->address()));
    absl::SleepFor(absl::Milliseconds(20));  // accepted and counted, in this order
  }
  // A fourth from the same address: over max_handshakes_per_peer, closed, not queued.
  const int fourth = ConnectFrom("127.0.0.1", (*t)->address());
  ASSERT_GE(fourth, 0);
  const absl::Time start = absl::Now();
  EXPECT_TRUE(ClosedWithin(fourth, absl::Milliseconds(200)));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(200)) << "queued rather than closed";
  close(fourth);
  // One from another address: the budget is full, so it takes the oldest one's place.
  const int fifth = ConnectFrom("127.0.0.5", (*t)->address());
  EXPECT_TRUE(ClosedWithin(held[0], absl::Milliseconds(200)));
  EXPECT_FALSE(ClosedWithin(fifth, absl::Milliseconds(100)));
  EXPECT_EQ(counters->refused_max_handshakes_per_peer.load(), 1u);
  EXPECT_EQ(counters->handshakes_evicted.load(), 1u);
  // The others time out at the handshake deadline; then there is room again.
  for (size_t i = 1; i < held.size(); ++i) EXPECT_TRUE(ClosedWithin(held[i], absl::Seconds(2)));
  EXPECT_TRUE(ClosedWithin(fifth, absl::Seconds(2)));
  EXPECT_EQ(counters->handshake_timeouts.load(), 3u);
  for (int fd : held) close(fd);
  close(fifth);
  absl::SleepFor(absl::Milliseconds(50));
  const int sixth = ConnectFrom("127.0.0.1", (*t)->address());
  EXPECT_FALSE(ClosedWithin(sixth, absl::Milliseconds(150)));
  close(sixth);
  EXPECT_EQ(counters->accepted.load(), 6u);
  EXPECT_EQ(counters->served.load(), 0u);
}

// Issue 35's data-port flood (plaintext): 80 TCP connections from 10 loopback addresses
// that never send a byte, reopened as the agent closes them. Before, they held all 64 served
// slots and every pull failed UNAVAILABLE for as long as the flood lasted. Now they wait in
// the handshake budget (64 in all, 8 an address) apart from the slots, a puller's first
// connection displaces the oldest pending one of the heaviest address, and every pull copies
// bit for bit.
TEST_F(TcpTransportTest, PullsGetThroughAFloodOfConnectionsThatNeverSendARequest) {
  auto counters = std::make_shared<DataPortCounters>();
  absl::StatusOr<std::unique_ptr<Transport>> ta =
      MakeTcpTransport({.counters = counters}, AgentPools{.main = a_.get()}, Tier::kGpu);
  ASSERT_TRUE(ta.ok()) << ta.status();
  ta_ = *std::move(ta);
  const std::vector<BlockId> from = CommitInA(4);
  testing::ConnectionFlood flood(*ParseAddress(ta_->address(), "address"),
                                 testing::ConnectionFlood::LoopbackSources(10), 8);
  // Through one handshake deadline: the flood's first connections have been closed and
  // reopened, and the budget is full of its second ones.
  testing::ConnectionFlood::WaitFor([&] { return counters->handshake_timeouts.load() > 0; });
  ASSERT_GT(counters->handshake_timeouts.load(), 0u);
  absl::SleepFor(absl::Milliseconds(100));
  for (int round = 0; round < 3; ++round) {
    const std::vector<BlockId> into = *b_->Allocate(4, kEpoch, &kNs);
    Outcome out;
    const absl::Time start = absl::Now();
    tb_->Pull(Spec(from, 0, into), out.Done());
    absl::StatusOr<TransferStats> r = out.Wait();
    const absl::Duration took = absl::Now() - start;
    ASSERT_TRUE(r.ok()) << "round " << round << ": " << r.status();
    EXPECT_LT(took, absl::Seconds(3)) << "round " << round;
    for (size_t i = 0; i < from.size(); ++i) EXPECT_EQ(Bytes(*b_, into[i]), Bytes(*a_, from[i]));
    absl::SleepFor(absl::Milliseconds(300));
  }
  EXPECT_GE(flood.opened(), 100u) << "the flood was not reopening";
  EXPECT_GT(counters->refused_max_handshakes.load(), 0u) << "the budget was never full";
  EXPECT_GE(counters->handshakes_evicted.load(), 1u);
  EXPECT_EQ(counters->served.load(), 3u) << "only the pulls completed a handshake";
  EXPECT_EQ(counters->refused_max_connections.load(), 0u);
}

TEST(TcpTransportLimitsTest, OptionsNameTheBadField) {
  EXPECT_THAT(TcpTransportOptions{.max_connections = 0}.Validate().message(),
              HasSubstr("max_connections"));
  EXPECT_THAT(TcpTransportOptions{.max_connections_per_peer = 0}.Validate().message(),
              HasSubstr("max_connections_per_peer"));
  EXPECT_THAT(TcpTransportOptions{.request_timeout_ms = 0}.Validate().message(),
              HasSubstr("request_timeout_ms"));
  EXPECT_THAT(TcpTransportOptions{.max_handshakes = 0}.Validate().message(),
              HasSubstr("max_handshakes"));
  EXPECT_THAT(TcpTransportOptions{.max_handshakes_per_peer = 0}.Validate().message(),
              HasSubstr("max_handshakes_per_peer"));
  EXPECT_THAT(TcpTransportOptions{.handshake_timeout_ms = 0}.Validate().message(),
              HasSubstr("handshake_timeout_ms"));
}

}  // namespace
}  // namespace kvcm
