// The PULL_MODE_NCCL data path of two data ports (tcp_transport.h with a LinkPort) over
// in-memory links: the handshake that bootstraps a link on first contact, chunks through the
// staging buffers, per-block checks on the server, link reuse, broken and stale links, the
// io timeout, the fallback to TCP bytes, and that no pool lock is held across a link wait.
// The same code runs over NCCL communicators in nccl_transport.cc; this runs on any CPU.

#include "gpu/agent/transport/link_transfer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/internal/endian.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gpu/agent/transport/data_socket.h"
#include "gpu/agent/transport/link_cache.h"
#include "gpu/agent/transport/tcp/tcp_transport.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"
#include "tests/util/fake_block_link.h"

namespace kvcm {
namespace {

using testing::FakeBlockLink;
using testing::FakeWire;

constexpr uint64_t kBlocks = 16;
constexpr uint64_t kEpoch = 3;
const NamespaceId kNs{"acme", "small"};

PageHash Page(uint64_t i) { return PageHash{i + 1, ~i}; }

// Polls `pred` every millisecond for up to 5 s.
template <typename Pred>
bool WaitUntil(Pred pred) {
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (!pred()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

absl::StatusOr<TransferStats> PullAndWait(Transport& t, PullSpec spec) {
  absl::Notification done;
  std::optional<absl::StatusOr<TransferStats>> result;
  t.Pull(std::move(spec), [&](absl::StatusOr<TransferStats> r) {
    result = std::move(r);
    done.Notify();
  });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  return result.value_or(absl::InternalError("no outcome"));
}

// One agent: a pool, a link cache and a data port over them. Its connector plays the
// manager's relay: it offers the other end of a new in-memory pair to the server directly.
struct Node {
  std::string id;
  std::unique_ptr<BlockPool> pool;
  std::unique_ptr<LinkCache> links;
  std::unique_ptr<Transport> transport;
  std::shared_ptr<FakeWire> wire = std::make_shared<FakeWire>();  // of every link it makes
  std::atomic<int> connects{0};
};

class LinkTransferTest : public ::testing::Test {
 protected:
  // Starts node `id` with links whose staging holds `staging_blocks` blocks (0: a plain TCP
  // data port) and at most `max_links` links of each kind.
  std::unique_ptr<Node> Start(const std::string& id, uint64_t staging_blocks,
                              uint32_t max_links = 16, uint32_t io_timeout_ms = 2'000) {
    auto n = std::make_unique<Node>();
    n->id = id;
    n->pool = MakeHostPool(SmallGqa(), kBlocks);
    const uint64_t staging = staging_blocks * n->pool->geometry().bytes_per_block();
    Node* raw = n.get();
    std::optional<LinkPort> port;
    if (staging_blocks > 0) {
      n->links = std::make_unique<LinkCache>(
          LinkCacheOptions{.max_links = max_links},
          [this, raw, staging](const std::string& peer, uint64_t link_id, const std::atomic<bool>&)
              -> absl::StatusOr<std::unique_ptr<BlockLink>> {
            ++raw->connects;
            Node* server = Find(peer);
            if (server == nullptr) return absl::NotFoundError(peer);
            auto [mine, theirs] = FakeBlockLink::Pair(staging, raw->wire);
            std::shared_ptr<BlockLink> served(std::move(theirs));
            absl::Status offered = server->links->OfferServed(
                raw->id, link_id,
                [served](const std::atomic<bool>&) -> absl::StatusOr<std::unique_ptr<BlockLink>> {
                  return std::unique_ptr<BlockLink>(new ForwardingLink(served));
                });
            if (!offered.ok()) return offered;
            return std::unique_ptr<BlockLink>(std::move(mine));
          });
      port = LinkPort{.agent_id = id, .links = n->links.get()};
    }
    absl::StatusOr<std::unique_ptr<Transport>> t = MakeTcpTransport(
        {.io_timeout_ms = io_timeout_ms}, AgentPools{.main = n->pool.get()}, Tier::kGpu, port);
    EXPECT_TRUE(t.ok()) << t.status();
    n->transport = *std::move(t);
    nodes_.push_back(n.get());
    return n;
  }

  Node* Find(const std::string& id) {
    for (Node* n : nodes_) {
      if (n->id == id) return n;
    }
    return nullptr;
  }

  // Commits `count` pages with random bytes in `node`'s pool; returns their blocks.
  std::vector<BlockId> Commit(Node& node, uint32_t count, uint64_t first_page = 0) {
    const uint64_t bb = node.pool->geometry().bytes_per_block();
    std::vector<BlockId> ids = *node.pool->Allocate(count, kEpoch, &kNs);
    std::vector<std::byte> bytes(count * bb);
    std::mt19937 rng(static_cast<uint32_t>(first_page + 11));
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
    EXPECT_TRUE(node.pool->WriteBlocks(ids, kEpoch, bytes).ok());
    std::vector<CommitEntry> entries;
    for (uint32_t i = 0; i < count; ++i) {
      entries.push_back({.block = ids[i], .page = Page(first_page + i)});
    }
    EXPECT_TRUE(node.pool->Commit(kNs, kEpoch, entries, "block_ids").ok());
    return ids;
  }

  std::vector<std::byte> Bytes(BlockPool& pool, BlockId id) {
    std::vector<std::byte> out(pool.geometry().bytes_per_block());
    EXPECT_TRUE(pool.ReadBlock(id, kEpoch, 0, out).ok());
    return out;
  }

  PullSpec Spec(Node& from, const std::vector<BlockId>& blocks, Node& into,
                const std::vector<BlockId>& dst) {
    PullSpec spec{.peer_address = from.transport->address(),
                  .ns = kNs,
                  .peer_blocks = blocks,
                  .dst = into.pool.get(),
                  .dst_blocks = dst,
                  .dst_owner_epoch = kEpoch};
    for (size_t i = 0; i < blocks.size(); ++i) spec.pages.push_back(Page(i));
    return spec;
  }

  // A served link that is a shared FakeBlockLink (the offer's join must hand over
  // ownership; the test keeps the pair's wire).
  class ForwardingLink final : public BlockLink {
   public:
    explicit ForwardingLink(std::shared_ptr<BlockLink> l) : l_(std::move(l)) {}
    uint64_t staging_bytes() const override { return l_->staging_bytes(); }
    absl::Status StageIn(const std::byte* s, uint64_t o, uint64_t b) override {
      return l_->StageIn(s, o, b);
    }
    absl::Status StageOut(uint64_t o, std::byte* d, uint64_t b) override {
      return l_->StageOut(o, d, b);
    }
    absl::Status Send(uint64_t b, absl::Duration t, const WaitCheck& c) override {
      return l_->Send(b, t, c);
    }
    absl::Status Recv(uint64_t b, absl::Duration t, const WaitCheck& c) override {
      return l_->Recv(b, t, c);
    }
    void Cancel() override { l_->Cancel(); }

   private:
    std::shared_ptr<BlockLink> l_;
  };

  std::vector<Node*> nodes_;
};

TEST_F(LinkTransferTest, BlocksTravelOnTheLinkInChunksAndTheLinkIsReused) {
  auto server = Start("gpu-1", /*staging_blocks=*/3);
  auto puller = Start("gpu-0", /*staging_blocks=*/3);
  const std::vector<BlockId> from = Commit(*server, 7);
  const std::vector<BlockId> into = *puller->pool->Allocate(7, kEpoch, &kNs);
  absl::StatusOr<TransferStats> r =
      PullAndWait(*puller->transport, Spec(*server, from, *puller, into));
  ASSERT_TRUE(r.ok()) << r.status();
  const uint64_t bb = server->pool->geometry().bytes_per_block();
  EXPECT_EQ(r->bytes, 7 * bb);
  for (size_t i = 0; i < from.size(); ++i) {
    EXPECT_EQ(Bytes(*puller->pool, into[i]), Bytes(*server->pool, from[i])) << "block " << i;
  }
  // First contact: the server answered link_needed, one link was bootstrapped, and every
  // byte went over it (chunks of 3, 3 and 1 blocks).
  EXPECT_EQ(puller->connects, 1);
  EXPECT_EQ(puller->wire->bytes_sent, 7 * bb);
  EXPECT_EQ(puller->links->pull_links(), 1u);
  EXPECT_EQ(server->links->served_links(), 1u);

  const std::vector<BlockId> again = *puller->pool->Allocate(7, kEpoch, &kNs);
  ASSERT_TRUE(PullAndWait(*puller->transport, Spec(*server, from, *puller, again)).ok());
  EXPECT_EQ(puller->connects, 1);  // cached
  EXPECT_EQ(puller->wire->bytes_sent, 14 * bb);
  EXPECT_EQ(Bytes(*puller->pool, again[6]), Bytes(*server->pool, from[6]));
}

TEST_F(LinkTransferTest, ABlockNoLongerHoldingItsPageFailsThePullAndKeepsTheLink) {
  auto server = Start("gpu-1", 3);
  auto puller = Start("gpu-0", 3);
  const std::vector<BlockId> from = Commit(*server, 7);
  const std::vector<BlockId> into = *puller->pool->Allocate(7, kEpoch, &kNs);
  ASSERT_TRUE(PullAndWait(*puller->transport, Spec(*server, from, *puller, into)).ok());
  // Block 4 (second chunk) is evicted: the first chunk went, the second is refused before
  // any of its bytes is sent.
  ASSERT_TRUE(server->pool->FreeCommitted({&from[4], 1}, kEpoch, "b").ok());
  const uint64_t sent = puller->wire->bytes_sent;
  absl::StatusOr<TransferStats> r =
      PullAndWait(*puller->transport, Spec(*server, from, *puller, into));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_THAT(r.status().message(), ::testing::HasSubstr("block_ids[4]"));
  EXPECT_EQ(puller->wire->bytes_sent - sent, 3 * server->pool->geometry().bytes_per_block());
  // The link is still good.
  const std::vector<BlockId> three = {from[0], from[1], from[2]};
  const std::vector<BlockId> dst = {into[0], into[1], into[2]};
  ASSERT_TRUE(PullAndWait(*puller->transport, Spec(*server, three, *puller, dst)).ok());
  EXPECT_EQ(puller->connects, 1);
}

TEST_F(LinkTransferTest, ALinkTheServerDroppedIsReplacedTransparently) {
  // The server keeps one served link: a second puller's link evicts the first's.
  auto server = Start("gpu-1", 2, /*max_links=*/1);
  auto p0 = Start("gpu-0", 2);
  auto p2 = Start("gpu-2", 2);
  const std::vector<BlockId> from = Commit(*server, 3);
  const std::vector<BlockId> into0 = *p0->pool->Allocate(3, kEpoch, &kNs);
  const std::vector<BlockId> into2 = *p2->pool->Allocate(3, kEpoch, &kNs);
  ASSERT_TRUE(PullAndWait(*p0->transport, Spec(*server, from, *p0, into0)).ok());
  ASSERT_TRUE(PullAndWait(*p2->transport, Spec(*server, from, *p2, into2)).ok());
  EXPECT_EQ(server->links->served_links(), 1u);
  // p0 still holds its link; the server answers link_needed and p0 bootstraps a new one.
  absl::StatusOr<TransferStats> r = PullAndWait(*p0->transport, Spec(*server, from, *p0, into0));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(p0->connects, 2);
  EXPECT_EQ(p0->links->pull_links(), 1u);
  EXPECT_EQ(p0->wire->destroyed, 2);  // p0's stale end and the server's evicted end
}

TEST_F(LinkTransferTest, ALinkOpThatNeverCompletesFailsThePullAndTheNextPullReconnects) {
  auto server = Start("gpu-1", 2, 16, /*io_timeout_ms=*/300);
  auto puller = Start("gpu-0", 2, 16, /*io_timeout_ms=*/300);
  const std::vector<BlockId> from = Commit(*server, 2);
  const std::vector<BlockId> into = *puller->pool->Allocate(2, kEpoch, &kNs);
  ASSERT_TRUE(PullAndWait(*puller->transport, Spec(*server, from, *puller, into)).ok());
  puller->wire->stall_sends = true;  // the server's send never completes
  const absl::Time start = absl::Now();
  absl::StatusOr<TransferStats> r =
      PullAndWait(*puller->transport, Spec(*server, from, *puller, into));
  // The server gives up after its io timeout and closes; the puller sees that (or its own
  // timeout) and fails.
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status()) || absl::IsUnavailable(r.status()))
      << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Both ends dropped (aborted) their link.
  ASSERT_TRUE(WaitUntil([&] { return server->links->served_links() == 0; }));
  EXPECT_EQ(puller->links->pull_links(), 0u);
  puller->wire->stall_sends = false;
  ASSERT_TRUE(PullAndWait(*puller->transport, Spec(*server, from, *puller, into)).ok());
  EXPECT_EQ(puller->connects, 2);
}

TEST_F(LinkTransferTest, NoPoolLockIsHeldWhileALinkWaits) {
  auto server = Start("gpu-1", 2);
  auto puller = Start("gpu-0", 2);
  const std::vector<BlockId> from = Commit(*server, 4);
  const std::vector<BlockId> into = *puller->pool->Allocate(4, kEpoch, &kNs);
  ASSERT_TRUE(PullAndWait(*puller->transport, Spec(*server, from, *puller, into)).ok());
  puller->wire->stall_sends = true;
  absl::Notification done;
  absl::Status status;
  puller->transport->Pull(Spec(*server, from, *puller, into), [&](absl::StatusOr<TransferStats> r) {
    status = r.status();
    done.Notify();
  });
  absl::SleepFor(absl::Milliseconds(100));  // the server's first send is now waiting
  ASSERT_FALSE(done.HasBeenNotified());
  // Both pools answer while the transfer waits on the link: no lock is held across it.
  for (Node* n : {server.get(), puller.get()}) {
    absl::StatusOr<std::vector<BlockId>> ids = n->pool->Allocate(1, kEpoch);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_TRUE(n->pool->Free(*ids, kEpoch).ok());
  }
  puller->wire->stall_sends = false;
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(status.ok()) << status;
}

TEST_F(LinkTransferTest, AServerWithoutLinksSendsTheBytesOverTcpAndAPlainPullerGetsTcp) {
  auto tcp_server = Start("gpu-1", /*staging_blocks=*/0);
  auto puller = Start("gpu-0", 2);
  const std::vector<BlockId> from = Commit(*tcp_server, 3);
  const std::vector<BlockId> into = *puller->pool->Allocate(3, kEpoch, &kNs);
  ASSERT_TRUE(PullAndWait(*puller->transport, Spec(*tcp_server, from, *puller, into)).ok());
  EXPECT_EQ(puller->connects, 0);
  EXPECT_EQ(Bytes(*puller->pool, into[2]), Bytes(*tcp_server->pool, from[2]));

  auto link_server = Start("gpu-2", 2);
  auto tcp_puller = Start("gpu-3", 0);
  const std::vector<BlockId> from2 = Commit(*link_server, 3);
  const std::vector<BlockId> into2 = *tcp_puller->pool->Allocate(3, kEpoch, &kNs);
  ASSERT_TRUE(
      PullAndWait(*tcp_puller->transport, Spec(*link_server, from2, *tcp_puller, into2)).ok());
  EXPECT_EQ(Bytes(*tcp_puller->pool, into2[0]), Bytes(*link_server->pool, from2[0]));
  EXPECT_EQ(link_server->links->served_links(), 0u);
}

// A server spoken by hand on a socket: it checks the puller's requests, answers the first
// with link_needed, then announces one chunk and never sends it on the link.
TEST_F(LinkTransferTest, ThePullerAsksForALinkThenTimesOutOnASilentOne) {
  auto puller = Start("gpu-0", 2, 16, /*io_timeout_ms=*/300);
  // The fake server "gpu-7" accepts offers into its own cache, so the connector works.
  auto silent = std::make_unique<Node>();
  silent->id = "gpu-7";
  silent->links = std::make_unique<LinkCache>(LinkCacheOptions{}, nullptr);
  nodes_.push_back(silent.get());
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  socklen_t len = sizeof(addr);
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  const uint64_t bb = puller->pool->geometry().bytes_per_block();
  std::vector<v1::PullBlocksRequest> seen;
  std::thread fake([&] {
    for (int i = 0; i < 2; ++i) {
      const int fd = accept(listener, nullptr, nullptr);
      SetSocketOptions(fd, 5'000);
      DataConn conn(fd);
      v1::PullBlocksRequest req;
      ASSERT_TRUE(RecvFrame(conn, &req).ok());
      seen.push_back(req);
      if (i == 0) {
        v1::PullBlocksHeader h = HeaderOf(absl::FailedPreconditionError("no link"), bb);
        h.set_link_needed(true);
        h.set_agent_id("gpu-7");
        ASSERT_TRUE(SendFrame(conn, h).ok());
      } else {
        ASSERT_TRUE(SendFrame(conn, HeaderOf(absl::OkStatus(), bb)).ok());
        char announce[5] = {static_cast<char>(kTagLinkChunk)};
        absl::little_endian::Store32(announce + 1, 1);
        ASSERT_TRUE(SendAll(conn, announce, sizeof(announce)).ok());
        char byte;
        (void)recv(fd, &byte, 1, 0);  // holds the connection until the puller gives up
      }
      close(fd);
    }
  });
  PullSpec spec{.peer_address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port)),
                .ns = kNs,
                .peer_blocks = {5},
                .pages = {Page(0)},
                .dst = puller->pool.get(),
                .dst_blocks = *puller->pool->Allocate(1, kEpoch, &kNs),
                .dst_owner_epoch = kEpoch};
  absl::StatusOr<TransferStats> r = PullAndWait(*puller->transport, spec);
  fake.join();
  close(listener);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_EQ(puller->links->pull_links(), 0u);  // dropped (aborted) after the timeout
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].mode(), v1::PULL_MODE_NCCL);
  EXPECT_EQ(seen[0].puller_agent_id(), "gpu-0");
  EXPECT_EQ(seen[0].link_id(), 0u);  // no link yet
  EXPECT_EQ(seen[1].mode(), v1::PULL_MODE_NCCL);
  EXPECT_NE(seen[1].link_id(), 0u);
  EXPECT_EQ(seen[1].link_chunk_bytes(), 2 * bb);
  EXPECT_EQ(silent->links->served_links(), 1u);  // the offer reached "gpu-7"
}

// Found by fuzz/data_port_fuzzer (fuzz/regressions/data_port_fuzzer/error_tag_with_ok_status):
// an OK status after the error tag aborted the puller (StatusOr built from an OK Status).
TEST(ReceiveBlocksTest, AnErrorTagCarryingAnOkStatusIsDataLoss) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 4);
  const NamespaceId ns{"t", "m"};
  PullSpec spec{.peer_address = "127.0.0.1:1",
                .ns = ns,
                .peer_blocks = {0, 1},
                .pages = {PageHash{1, 1}, PageHash{2, 2}},
                .dst = pool.get(),
                .dst_blocks = *pool->Allocate(2, 1, &ns),
                .dst_owner_epoch = 1};
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  const std::string block(pool->geometry().bytes_per_block(), 'b');
  DataConn server(fds[1]);
  DataConn puller(fds[0]);
  ASSERT_TRUE(SendAll(server, &kTagBlock, 1).ok());
  ASSERT_TRUE(SendAll(server, block.data(), block.size()).ok());
  ASSERT_TRUE(SendAll(server, &kTagError, 1).ok());
  ASSERT_TRUE(SendFrame(server, HeaderOf(absl::OkStatus(), block.size())).ok());
  bool broken = false;
  absl::StatusOr<uint64_t> got = ReceiveBlocks(puller, spec, nullptr, absl::Seconds(5), &broken);
  close(fds[0]);
  close(fds[1]);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_FALSE(broken);
}

// Found while writing fuzz/data_port_fuzzer: link_needed with code 0 aborted the puller
// (StatusOr built from an OK Status).
TEST_F(LinkTransferTest, ALinkNeededHeaderWithAnOkCodeFailsThePull) {
  auto puller = Start("gpu-0", 2, 16, /*io_timeout_ms=*/300);
  auto silent = std::make_unique<Node>();
  silent->id = "gpu-7";
  silent->links = std::make_unique<LinkCache>(LinkCacheOptions{}, nullptr);
  nodes_.push_back(silent.get());
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  socklen_t len = sizeof(addr);
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  const uint64_t bb = puller->pool->geometry().bytes_per_block();
  std::thread fake([&] {
    for (int i = 0; i < 2; ++i) {
      const int fd = accept(listener, nullptr, nullptr);
      SetSocketOptions(fd, 5'000);
      DataConn conn(fd);
      v1::PullBlocksRequest req;
      ASSERT_TRUE(RecvFrame(conn, &req).ok());
      v1::PullBlocksHeader h = HeaderOf(absl::OkStatus(), bb);
      h.set_link_needed(true);
      h.set_agent_id("gpu-7");
      ASSERT_TRUE(SendFrame(conn, h).ok());
      close(fd);
    }
  });
  PullSpec spec{.peer_address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port)),
                .ns = kNs,
                .peer_blocks = {5},
                .pages = {Page(0)},
                .dst = puller->pool.get(),
                .dst_blocks = *puller->pool->Allocate(1, kEpoch, &kNs),
                .dst_owner_epoch = kEpoch};
  absl::StatusOr<TransferStats> r = PullAndWait(*puller->transport, spec);
  fake.join();
  close(listener);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
}

TEST(LinkChunkBlocksTest, TheSmallerStagingBoundsAChunk) {
  EXPECT_EQ(*LinkChunkBlocks(100, 1000, 0), 10u);
  EXPECT_EQ(*LinkChunkBlocks(100, 1000, 350), 3u);
  EXPECT_EQ(*LinkChunkBlocks(100, 250, 5000), 2u);
  EXPECT_EQ(LinkChunkBlocks(100, 1000, 99).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LinkChunkBlocks(100, 50, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcm
