// The TCP transport's data port over mutual TLS (gpu/agent/transport/data_tls.h): pulls between two
// agents holding certificates of the cluster CA copy bit for bit, and so do large blocks
// streamed in place through a session (block_stream.h); a peer without such a
// certificate, or speaking plaintext, gets no block byte either way; a silent peer fails the
// handshake at the io timeout; a certificate replaced on disk is used by new connections.
#include "gpu/agent/transport/data_tls.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/page_hash.h"
#include "gmock/gmock.h"
#include "gpu/agent/transport/block_stream.h"
#include "gpu/agent/transport/data_socket.h"
#include "gpu/agent/transport/link_transfer.h"
#include "gpu/agent/transport/tcp/tcp_transport.h"
#include "gtest/gtest.h"
#include "proto/core_types.h"
#include "tests/util/agent_pools.h"
#include "tests/util/connection_flood.h"
#include "tests/util/test_certs.h"

namespace kvcm {
namespace {

using ::kvcm::testing::TestCerts;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr uint64_t kBlocks = 16;
constexpr uint64_t kEpoch = 3;
const NamespaceId kNs{"acme", "small"};

PageHash Page(uint64_t i) { return PageHash{i + 1, ~i}; }

absl::StatusOr<TransferStats> PullAndWait(Transport& t, PullSpec spec) {
  absl::Notification done;
  absl::StatusOr<TransferStats> result = absl::InternalError("no outcome");
  t.Pull(std::move(spec), [&](absl::StatusOr<TransferStats> r) {
    result = std::move(r);
    done.Notify();
  });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  return result;
}

// A connected loopback socket to `address` ("127.0.0.1:port"), or -1.
int ConnectTo(const std::string& address) {
  absl::StatusOr<sockaddr_in> addr = ParseAddress(address, "address");
  if (!addr.ok()) return -1;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    close(fd);
    return -1;
  }
  SetSocketOptions(fd, 5'000);
  return fd;
}

// Pool A with committed random pages served by transport `ta_`; pool B pulled into by `tb_`.
class DataTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestCerts>> certs = TestCerts::Make({"agent-a", "agent-b"});
    ASSERT_TRUE(certs.ok()) << certs.status();
    certs_ = *std::move(certs);
    a_ = MakeHostPool(SmallGqa(), kBlocks);
    b_ = MakeHostPool(SmallGqa(), kBlocks);
    block_bytes_ = a_->geometry().bytes_per_block();
    from_ = *a_->Allocate(4, kEpoch, &kNs);
    std::vector<std::byte> bytes(4 * block_bytes_);
    std::mt19937 rng(7);
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
    ASSERT_TRUE(a_->WriteBlocks(from_, kEpoch, bytes).ok());
    std::vector<CommitEntry> entries;
    for (uint32_t i = 0; i < 4; ++i) {
      entries.push_back(
          {.block = from_[i], .page = Page(i), .parent = i == 0 ? PageHash{} : Page(i - 1)});
    }
    ASSERT_TRUE(a_->Commit(kNs, kEpoch, entries, "block_ids").ok());
  }

  // `identity`'s DataTls (trusting ca.pem), or null for plaintext.
  std::shared_ptr<DataTls> Tls(const std::optional<std::string>& identity) {
    if (!identity.has_value()) return nullptr;
    TlsOptions tls = certs_->Identity(*identity);
    tls.ca_file = certs_->Path("ca.pem");
    absl::StatusOr<std::shared_ptr<DataTls>> made = DataTls::Create(tls);
    EXPECT_TRUE(made.ok()) << made.status();
    return made.ok() ? *made : nullptr;
  }

  void StartA(const std::optional<std::string>& identity, uint32_t io_timeout_ms = 5'000) {
    ta_ = *MakeTcpTransport({.io_timeout_ms = io_timeout_ms, .tls = Tls(identity)},
                            AgentPools{.main = a_.get()}, Tier::kGpu);
  }
  void StartB(const std::optional<std::string>& identity, uint32_t io_timeout_ms = 5'000) {
    tb_ = *MakeTcpTransport({.io_timeout_ms = io_timeout_ms, .tls = Tls(identity)},
                            AgentPools{.main = b_.get()}, Tier::kGpu);
  }

  // Pulls A's four pages into four new blocks of B; the blocks, or the pull's error.
  absl::StatusOr<std::vector<BlockId>> PullAll(const std::string& peer) {
    std::vector<BlockId> into = *b_->Allocate(4, kEpoch, &kNs);
    PullSpec spec{.peer_address = peer,
                  .peer_tier = Tier::kGpu,
                  .ns = kNs,
                  .peer_blocks = from_,
                  .dst = b_.get(),
                  .dst_blocks = into,
                  .dst_owner_epoch = kEpoch};
    for (uint32_t i = 0; i < 4; ++i) spec.pages.push_back(Page(i));
    absl::StatusOr<TransferStats> r = PullAndWait(*tb_, std::move(spec));
    if (!r.ok()) {
      EXPECT_TRUE(b_->Free(into, kEpoch).ok());
      return r.status();
    }
    EXPECT_EQ(r->bytes, 4 * block_bytes_);
    return into;
  }

  std::vector<std::byte> Bytes(BlockPool& pool, BlockId id) {
    std::vector<std::byte> out(block_bytes_);
    EXPECT_TRUE(pool.ReadBlock(id, kEpoch, 0, out).ok());
    return out;
  }

  std::unique_ptr<TestCerts> certs_;
  std::unique_ptr<BlockPool> a_, b_;
  uint64_t block_bytes_ = 0;
  std::vector<BlockId> from_;
  std::unique_ptr<Transport> ta_, tb_;
};

TEST_F(DataTlsTest, APullBetweenTwoAgentsOfTheCaCopiesBitForBit) {
  StartA("agent-a");
  StartB("agent-b");
  absl::StatusOr<std::vector<BlockId>> into = PullAll(ta_->address());
  ASSERT_TRUE(into.ok()) << into.status();
  for (size_t i = 0; i < from_.size(); ++i) {
    EXPECT_EQ(Bytes(*b_, (*into)[i]), Bytes(*a_, from_[i])) << "block " << i;
  }
  // Again on a fresh connection: the context serves any number of handshakes.
  EXPECT_TRUE(PullAll(ta_->address()).ok());
}

// Blocks of 1 MiB moved in place over a TLS session on a loopback pair with small socket
// buffers (block_stream.h): many records, many waits for room, each piece under the pool's
// lock. They arrive bit for bit; a block freed mid-stream stops the stream, and the receiver
// never sees it whole.
class DataTlsInPlaceTest : public DataTlsTest {
 protected:
  void SetUp() override {
    DataTlsTest::SetUp();
    ModelSpec big = SmallGqa();
    big.num_layers = 32;
    big.head_dim = 128;
    big.page_size_tokens = 16;
    src_ = MakeHostPool(big, 2);
    dst_ = MakeHostPool(big, 2);
    big_bytes_ = src_->geometry().bytes_per_block();
    ASSERT_EQ(big_bytes_, 1u << 20);
    big_from_ = *src_->Allocate(2, kEpoch, &kNs);
    std::vector<std::byte> bytes(2 * big_bytes_);
    std::mt19937 rng(9);
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
    ASSERT_TRUE(src_->WriteBlocks(big_from_, kEpoch, bytes).ok());
    const std::vector<CommitEntry> entries = {
        {.block = big_from_[0], .page = Page(0), .parent = PageHash{}},
        {.block = big_from_[1], .page = Page(1), .parent = Page(0)}};
    ASSERT_TRUE(src_->Commit(kNs, kEpoch, entries, "block_ids").ok());
    big_into_ = *dst_->Allocate(2, kEpoch, &kNs);

    const int listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(listen(listener, 1), 0);
    ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    sender_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    const int small = 16 << 10;
    setsockopt(sender_fd_, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    ASSERT_EQ(connect(sender_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    receiver_fd_ = accept(listener, nullptr, nullptr);
    close(listener);
    setsockopt(receiver_fd_, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    SetSocketOptions(sender_fd_, 5'000);
    SetSocketOptions(receiver_fd_, 5'000);
    std::shared_ptr<DataTls> a = Tls("agent-a"), b = Tls("agent-b");
    absl::StatusOr<DataConn> server = absl::InternalError("no handshake");
    std::thread accept_thread([&] { server = a->Accept(sender_fd_); });
    absl::StatusOr<DataConn> client = b->Connect(receiver_fd_);
    accept_thread.join();
    ASSERT_TRUE(server.ok()) << server.status();
    ASSERT_TRUE(client.ok()) << client.status();
    out_.emplace(*std::move(server));
    in_.emplace(*std::move(client));
  }
  void TearDown() override {
    out_.reset();
    in_.reset();
    close(sender_fd_);
    close(receiver_fd_);
  }

  std::vector<std::byte> BigBytes(BlockPool& pool, BlockId id) {
    std::vector<std::byte> out(big_bytes_);
    EXPECT_TRUE(pool.ReadBlock(id, kEpoch, 0, out).ok());
    return out;
  }

  std::unique_ptr<BlockPool> src_, dst_;
  uint64_t big_bytes_ = 0;
  std::vector<BlockId> big_from_, big_into_;
  int sender_fd_ = -1, receiver_fd_ = -1;
  std::optional<DataConn> out_, in_;  // the server's end sends, the client's receives
};

TEST_F(DataTlsInPlaceTest, BlocksArriveBitForBit) {
  absl::Status sent;
  std::thread sender([&] {
    for (int i = 0; i < 2 && sent.ok(); ++i) {
      bool answerable = false;
      sent = SendCommittedBlockInPlace(*out_, *src_, big_from_[i], kNs, Page(i), "block_ids",
                                       absl::Seconds(5), &answerable);
    }
  });
  for (int i = 0; i < 2; ++i) {
    uint8_t tag = 0;
    ASSERT_TRUE(RecvAll(*in_, &tag, 1).ok());
    EXPECT_EQ(tag, kTagBlock);
    absl::Status got =
        RecvBlockInPlace(*in_, *dst_, big_into_[i], kEpoch, 0, "dst_blocks", absl::Seconds(5));
    ASSERT_TRUE(got.ok()) << got;
  }
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent;
  EXPECT_EQ(BigBytes(*dst_, big_into_[0]), BigBytes(*src_, big_from_[0]));
  EXPECT_EQ(BigBytes(*dst_, big_into_[1]), BigBytes(*src_, big_from_[1]));
  // The session is still usable in blocking mode after the in-place blocks.
  const uint8_t done = kTagDone;
  ASSERT_TRUE(SendAll(*in_, &done, 1).ok());
  uint8_t back = 0;
  ASSERT_TRUE(RecvAll(*out_, &back, 1).ok());
  EXPECT_EQ(back, kTagDone);
}

TEST_F(DataTlsInPlaceTest, ABlockFreedMidStreamNeverArrivesWhole) {
  absl::Status sent;
  bool answerable = true;
  std::thread sender([&] {
    sent = SendCommittedBlockInPlace(*out_, *src_, big_from_[0], kNs, Page(0), "block_ids[0]",
                                     absl::Seconds(5), &answerable);
    shutdown(sender_fd_, SHUT_WR);  // the server closes the connection
  });
  pollfd p{.fd = receiver_fd_, .events = POLLIN, .revents = 0};
  ASSERT_EQ(poll(&p, 1, 5000), 1);  // records are out: the sender waits for room, unlocked
  ASSERT_TRUE(src_->FreeCommitted({&big_from_[0], 1}, kEpoch, "free").ok());
  uint8_t tag = 0;
  ASSERT_TRUE(RecvAll(*in_, &tag, 1).ok());
  absl::Status got =
      RecvBlockInPlace(*in_, *dst_, big_into_[0], kEpoch, 0, "dst_blocks[0]", absl::Seconds(5));
  sender.join();
  EXPECT_EQ(sent.code(), absl::StatusCode::kFailedPrecondition) << sent;
  EXPECT_FALSE(answerable);
  EXPECT_EQ(got.code(), absl::StatusCode::kUnavailable) << got;
}

// The data-port starvation over TLS: 16 peers that connect and send no TLS byte, and
// one that drips a ClientHello a byte at a time, hold no slot a pull needs; the handshake
// deadline (data_handshake_timeout_ms, 1 s) closes all of them mid-handshake.
TEST_F(DataTlsTest, SilentAndDrippingHandshakesHoldNoSlotAPullNeeds) {
  StartA("agent-a");
  StartB("agent-b");
  const sockaddr_in a = *ParseAddress(ta_->address(), "address");
  auto connect_from = [&](const char* from) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in src{};
    src.sin_family = AF_INET;
    inet_pton(AF_INET, from, &src.sin_addr);
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)), 0);
    EXPECT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)), 0);
    return fd;
  };
  std::vector<int> idle;
  for (int i = 0; i < 16; ++i) idle.push_back(connect_from(i % 2 == 0 ? "127.0.0.2" : "127.0.0.3"));
  const int dripper = connect_from("127.0.0.4");
  std::thread drip([dripper] {
    const unsigned char hello[] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01};  // a record header...
    for (unsigned char byte : hello) {
      if (send(dripper, &byte, 1, MSG_NOSIGNAL) != 1) return;
      absl::SleepFor(absl::Milliseconds(400));
    }
  });

  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<BlockId>> into = PullAll(ta_->address());
  ASSERT_TRUE(into.ok()) << into.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "the pull waited behind idle handshakes";

  auto closed_within = [](int fd, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    char buf[512];
    while (absl::Now() < deadline) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      const ssize_t got = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) return true;
    }
    return false;
  };
  for (int fd : idle) EXPECT_TRUE(closed_within(fd, absl::Seconds(3)));
  EXPECT_TRUE(closed_within(dripper, absl::Seconds(3)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  drip.join();
  for (int fd : idle) close(fd);
  close(dripper);
}

// Whether the server closed `fd` within `timeout` (what it sent first is dropped).
bool ServerClosedWithin(int fd, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  char buf[512];
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 20) <= 0) continue;
    const ssize_t got = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
  return false;
}

// Issue 35's data-port flood over mutual TLS: 80 TCP connections from 10 loopback addresses
// that never send a TLS byte, reopened as the agent closes them. Before, they held all 64
// served slots and every pull failed UNAVAILABLE for as long as the flood lasted. Now a
// connection takes a slot only once its handshake completed; until then it waits in the
// handshake budget (64 in all, 8 an address), where a puller's first connection displaces
// the oldest pending one of the heaviest address. Every pull copies bit for bit.
TEST_F(DataTlsTest, PullsGetThroughAFloodOfConnectionsThatNeverHandshake) {
  auto counters = std::make_shared<DataPortCounters>();
  ta_ = *MakeTcpTransport({.tls = Tls("agent-a"), .counters = counters},
                          AgentPools{.main = a_.get()}, Tier::kGpu);
  StartB("agent-b");
  kvcm::testing::ConnectionFlood flood(*ParseAddress(ta_->address(), "address"),
                                       kvcm::testing::ConnectionFlood::LoopbackSources(10), 8);
  // Through one handshake deadline: the flood's first connections have been closed and
  // reopened, and the budget is full of its second ones.
  kvcm::testing::ConnectionFlood::WaitFor([&] { return counters->handshake_timeouts.load() > 0; });
  ASSERT_GT(counters->handshake_timeouts.load(), 0u);
  absl::SleepFor(absl::Milliseconds(100));
  for (int round = 0; round < 3; ++round) {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<BlockId>> into = PullAll(ta_->address());
    const absl::Duration took = absl::Now() - start;
    ASSERT_TRUE(into.ok()) << "round " << round << ": " << into.status();
    EXPECT_LT(took, absl::Seconds(3)) << "round " << round;
    for (size_t i = 0; i < from_.size(); ++i) {
      EXPECT_EQ(Bytes(*b_, (*into)[i]), Bytes(*a_, from_[i])) << "round " << round;
    }
    absl::SleepFor(absl::Milliseconds(300));
  }
  EXPECT_GE(flood.opened(), 100u) << "the flood was not reopening";
  EXPECT_GT(counters->refused_max_handshakes.load(), 0u) << "the budget was never full";
  EXPECT_GE(counters->handshakes_evicted.load(), 1u);
  EXPECT_EQ(counters->served.load(), 3u) << "only the pulls completed a handshake";
  EXPECT_EQ(counters->refused_max_connections.load(), 0u);
}

// Completed handshakes take the served slots (max_connections) and pending ones do not:
// silent connections beside a TLS session holding the only slot change nothing, and a second
// session that completes its handshake is closed for want of a slot until the first is gone.
TEST_F(DataTlsTest, OnlyCompletedHandshakesTakeServedSlots) {
  auto counters = std::make_shared<DataPortCounters>();
  ta_ = *MakeTcpTransport({.max_connections = 1,
                           .request_timeout_ms = 1'500,
                           .tls = Tls("agent-a"),
                           .counters = counters},
                          AgentPools{.main = a_.get()}, Tier::kGpu);
  StartB("agent-b");
  std::vector<int> silent;
  for (int i = 0; i < 3; ++i) silent.push_back(ConnectTo(ta_->address()));
  std::shared_ptr<DataTls> tls = Tls("agent-b");
  const int first_fd = ConnectTo(ta_->address());
  absl::StatusOr<DataConn> first = tls->Connect(first_fd);
  ASSERT_TRUE(first.ok()) << first.status();
  // The server's side of the handshake completes on its own thread, soon after ours.
  EXPECT_TRUE(
      kvcm::testing::ConnectionFlood::WaitFor([&] { return counters->served.load() == 1; }));
  const int second_fd = ConnectTo(ta_->address());
  absl::StatusOr<DataConn> second = tls->Connect(second_fd);
  EXPECT_TRUE(ServerClosedWithin(second_fd, absl::Seconds(5)));
  EXPECT_EQ(counters->refused_max_connections.load(), 1u);
  EXPECT_FALSE(ServerClosedWithin(first_fd, absl::Milliseconds(50)));
  // The first session sends no request: the request deadline closes it, and the slot is free.
  EXPECT_TRUE(ServerClosedWithin(first_fd, absl::Seconds(3)));
  // The server frees the slot as it closes; a pull that still finds it taken is refused.
  absl::StatusOr<std::vector<BlockId>> into = PullAll(ta_->address());
  for (const absl::Time end = absl::Now() + absl::Seconds(5); !into.ok() && absl::Now() < end;) {
    absl::SleepFor(absl::Milliseconds(50));
    into = PullAll(ta_->address());
  }
  ASSERT_TRUE(into.ok()) << into.status();
  EXPECT_EQ(Bytes(*b_, (*into)[0]), Bytes(*a_, from_[0]));
  for (int fd : silent) close(fd);
  second = absl::CancelledError("closed");
  close(second_fd);
  first = absl::CancelledError("closed");
  close(first_fd);
}

TEST_F(DataTlsTest, APeerWithoutACertificateOfTheCaIsRefusedBothWays) {
  StartA("agent-a");
  StartB("untrusted");  // signed by the untrusted CA, trusting ours
  // TLS 1.3: the puller's handshake completes before A refuses its certificate, so the
  // refusal (an alert) ends its first read.
  absl::StatusOr<std::vector<BlockId>> pulled = PullAll(ta_->address());
  EXPECT_EQ(pulled.status().code(), absl::StatusCode::kUnavailable) << pulled.status();

  // The other way round: an agent of the CA does not pull from a server it cannot verify.
  std::unique_ptr<Transport> stranger =
      *MakeTcpTransport({.tls = Tls("untrusted")}, AgentPools{.main = a_.get()}, Tier::kGpu);
  StartB("agent-b");
  pulled = PullAll(stranger->address());
  EXPECT_EQ(pulled.status().code(), absl::StatusCode::kUnavailable) << pulled.status();
  EXPECT_THAT(pulled.status().message(), HasSubstr("certificate"));
}

TEST_F(DataTlsTest, PlaintextAndTlsDoNotMix) {
  // A plaintext server may read a ClientHello as the length of a frame and wait for it.
  StartA("agent-a", /*io_timeout_ms=*/1'000);
  StartB(std::nullopt, /*io_timeout_ms=*/1'000);
  EXPECT_FALSE(PullAll(ta_->address()).ok()) << "a plaintext puller of a TLS port";

  std::unique_ptr<Transport> plain =
      *MakeTcpTransport({.io_timeout_ms = 1'000}, AgentPools{.main = a_.get()}, Tier::kGpu);
  StartB("agent-b", /*io_timeout_ms=*/1'000);
  EXPECT_FALSE(PullAll(plain->address()).ok()) << "a TLS puller of a plaintext port";
}

// A plaintext request for committed blocks, written by hand: not one block byte comes back.
TEST_F(DataTlsTest, APlaintextRequestGetsNoBlockBytes) {
  StartA("agent-a");
  const int fd = ConnectTo(ta_->address());
  ASSERT_GE(fd, 0);
  v1::PullBlocksRequest req;
  req.set_tier(v1::TIER_GPU);
  NamespaceToProto(kNs, req.mutable_namespace_());
  req.mutable_block_ids()->Add(from_.begin(), from_.end());
  std::vector<PageHash> pages;
  for (uint32_t i = 0; i < 4; ++i) pages.push_back(Page(i));
  req.set_page_hashes(EncodePageHashes(pages));
  DataConn conn(fd);
  (void)SendFrame(conn, req);  // the server may already have dropped the connection
  std::vector<char> answer;
  char buf[4096];
  while (true) {
    const ssize_t got = recv(fd, buf, sizeof(buf), 0);
    if (got <= 0) break;
    answer.insert(answer.end(), buf, buf + got);
  }
  close(fd);
  EXPECT_LT(answer.size(), block_bytes_) << "the server answered with data";
  const std::string text(answer.begin(), answer.end());
  const std::vector<std::byte> first = Bytes(*a_, from_[0]);
  const std::string block(reinterpret_cast<const char*>(first.data()), 64);
  EXPECT_EQ(text.find(block), std::string::npos);
}

TEST_F(DataTlsTest, ASilentServerFailsTheHandshakeAtTheIoTimeout) {
  // A listener that accepts (the kernel's backlog) and never speaks.
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  StartB("agent-b", /*io_timeout_ms=*/300);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<BlockId>> pulled =
      PullAll(absl::StrCat("127.0.0.1:", ntohs(addr.sin_port)));
  EXPECT_EQ(pulled.status().code(), absl::StatusCode::kDeadlineExceeded) << pulled.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  close(listener);
}

TEST_F(DataTlsTest, ACertificateReplacedOnDiskIsUsedByNewConnections) {
  StartA("agent-a");
  StartB("agent-b");
  ASSERT_TRUE(PullAll(ta_->address()).ok());
  // A now presents a certificate of the untrusted CA: B refuses it once A has reloaded
  // (its files are looked at every second).
  ASSERT_TRUE(certs_->Replace("agent-a", "untrusted").ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(15);
  absl::StatusOr<std::vector<BlockId>> pulled = std::vector<BlockId>{};
  do {
    if (pulled.ok() && !pulled->empty()) {
      ASSERT_TRUE(b_->Free(*pulled, kEpoch).ok());
    }
    absl::SleepFor(absl::Milliseconds(200));
    pulled = PullAll(ta_->address());
  } while (pulled.ok() && absl::Now() < give_up);
  EXPECT_EQ(pulled.status().code(), absl::StatusCode::kUnavailable) << pulled.status();
}

TEST(DataTlsCreateTest, EveryFileIsRequiredAndChecked) {
  absl::StatusOr<std::unique_ptr<TestCerts>> certs = TestCerts::Make({"agent-a"});
  ASSERT_TRUE(certs.ok()) << certs.status();
  TlsOptions tls = (*certs)->Identity("agent-a");
  EXPECT_TRUE(DataTls::Create(tls).ok());
  TlsOptions no_ca = tls;
  no_ca.ca_file.clear();
  EXPECT_THAT(DataTls::Create(no_ca).status().message(), HasSubstr("ca_file is required"));
  TlsOptions missing = tls;
  missing.key_file = (*certs)->Path("gone.key");
  const absl::Status s = DataTls::Create(missing).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AnyOf(HasSubstr("key_file \""), HasSubstr("gone.key")));
}

}  // namespace
}  // namespace kvcm
