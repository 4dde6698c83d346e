#include "gpu/agent/transport/block_stream.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"

namespace kvcm {
namespace {

constexpr uint64_t kEpoch = 5;
const NamespaceId kNs{"acme", "big"};
constexpr absl::Duration kTimeout = absl::Seconds(5);

PageHash Page(uint64_t i) { return PageHash{i + 1, ~i}; }

// Blocks of 1 MiB: far more than the tiny socket buffers below, so a block moves in many
// pieces with waits between them.
ModelSpec MiBBlocks() {
  ModelSpec s = SmallGqa();
  s.num_layers = 32;
  s.head_dim = 128;
  s.page_size_tokens = 16;
  return s;
}

// A connected loopback TCP pair with small socket buffers (and TCP_NODELAY, as the data
// port sets: small writes wait for no delayed ack).
class SocketPair {
 public:
  SocketPair() {
    const int listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(listener, 1), 0);
    EXPECT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    sender_ = socket(AF_INET, SOCK_STREAM, 0);
    const int small = 16 << 10, one = 1;
    setsockopt(sender_, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    setsockopt(sender_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    EXPECT_EQ(connect(sender_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    receiver_ = accept(listener, nullptr, nullptr);
    setsockopt(receiver_, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    close(listener);
  }
  ~SocketPair() {
    close(sender_);
    close(receiver_);
  }
  int sender() const { return sender_; }
  int receiver() const { return receiver_; }

 private:
  int sender_ = -1;
  int receiver_ = -1;
};

class BlockStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = MakeHostPool(MiBBlocks(), 4);
    b_ = MakeHostPool(MiBBlocks(), 4);
    block_bytes_ = a_->geometry().bytes_per_block();
    ASSERT_EQ(block_bytes_, 1u << 20);
    from_ = *a_->Allocate(2, kEpoch, &kNs);
    std::vector<std::byte> bytes(2 * block_bytes_);
    std::mt19937 rng(11);
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
    ASSERT_TRUE(a_->WriteBlocks(from_, kEpoch, bytes).ok());
    const std::vector<CommitEntry> entries = {
        {.block = from_[0], .page = Page(0), .parent = PageHash{}},
        {.block = from_[1], .page = Page(1), .parent = Page(0)}};
    ASSERT_TRUE(a_->Commit(kNs, kEpoch, entries, "block_ids").ok());
    into_ = *b_->Allocate(2, kEpoch, &kNs);
  }

  std::vector<std::byte> Bytes(BlockPool& pool, BlockId id) {
    std::vector<std::byte> out(block_bytes_);
    EXPECT_TRUE(pool.ReadBlock(id, kEpoch, 0, out).ok());
    return out;
  }

  std::unique_ptr<BlockPool> a_, b_;
  uint64_t block_bytes_ = 0;
  std::vector<BlockId> from_, into_;
  SocketPair pair_;
};

TEST_F(BlockStreamTest, HostPoolsStreamInPlace) {
  EXPECT_TRUE(CanSendInPlace(*a_));
  EXPECT_TRUE(CanRecvInPlace(*b_));
}

TEST_F(BlockStreamTest, BlocksArriveBitForBitInManyPieces) {
  DataConn out(pair_.sender()), in(pair_.receiver());
  absl::Status sent;
  bool answerable = true;
  std::thread sender([&] {
    for (int i = 0; i < 2 && sent.ok(); ++i) {
      sent = SendCommittedBlockInPlace(out, *a_, from_[i], kNs, Page(i), "block_ids[i]", kTimeout,
                                       &answerable);
    }
  });
  for (int i = 0; i < 2; ++i) {
    uint8_t tag = 0;
    ASSERT_TRUE(RecvAll(in, &tag, 1).ok());
    EXPECT_EQ(tag, kTagBlock);
    ASSERT_TRUE(RecvBlockInPlace(in, *b_, into_[i], kEpoch, 0, "dst_blocks[i]", kTimeout).ok());
  }
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent;
  EXPECT_EQ(Bytes(*b_, into_[0]), Bytes(*a_, from_[0]));
  EXPECT_EQ(Bytes(*b_, into_[1]), Bytes(*a_, from_[1]));
}

TEST_F(BlockStreamTest, ABlockFreedBeforeItsFirstByteIsAnswerable) {
  ASSERT_TRUE(a_->FreeCommitted({&from_[1], 1}, kEpoch, "free").ok());
  DataConn out(pair_.sender());
  bool answerable = false;
  absl::Status s = SendCommittedBlockInPlace(out, *a_, from_[1], kNs, Page(1), "block_ids[1]",
                                             kTimeout, &answerable);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), ::testing::HasSubstr("block_ids[1]"));
  EXPECT_TRUE(answerable);
  // Nothing, not even the tag, went out.
  char byte;
  EXPECT_EQ(recv(pair_.receiver(), &byte, 1, MSG_DONTWAIT), -1);
}

TEST_F(BlockStreamTest, ABlockFreedMidStreamStopsItBeforeItArrivesWhole) {
  DataConn out(pair_.sender()), in(pair_.receiver());
  absl::Status sent;
  bool answerable = true;
  std::thread sender([&] {
    sent = SendCommittedBlockInPlace(out, *a_, from_[0], kNs, Page(0), "block_ids[0]", kTimeout,
                                     &answerable);
    shutdown(pair_.sender(), SHUT_WR);  // what closing the connection tells the puller
  });
  // The first piece is out (the tag with it) and the sender waits for room, holding no lock:
  // the block can be freed under it.
  pollfd p{.fd = pair_.receiver(), .events = POLLIN, .revents = 0};
  ASSERT_EQ(poll(&p, 1, 5000), 1);
  ASSERT_TRUE(a_->FreeCommitted({&from_[0], 1}, kEpoch, "free").ok());
  uint8_t tag = 0;
  ASSERT_TRUE(RecvAll(in, &tag, 1).ok());
  absl::Status got = RecvBlockInPlace(in, *b_, into_[0], kEpoch, 0, "dst_blocks[0]", kTimeout);
  sender.join();
  EXPECT_EQ(sent.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(answerable);
  EXPECT_EQ(got.code(), absl::StatusCode::kUnavailable) << got;
}

TEST_F(BlockStreamTest, ReceivingChecksTheDestinationBlock) {
  DataConn in(pair_.receiver());
  const char byte = 1;
  ASSERT_EQ(send(pair_.sender(), &byte, 1, 0), 1);
  // Freed by its owner: refused before a byte lands in it.
  ASSERT_TRUE(b_->Free({&into_[0], 1}, kEpoch).ok());
  absl::Status s = RecvBlockInPlace(in, *b_, into_[0], kEpoch, 0, "dst_blocks[0]", kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), ::testing::HasSubstr("dst_blocks[0]"));
  // An allocation that ended: ABORTED.
  std::vector<uint64_t> gens;
  const std::vector<BlockId> again = *b_->Allocate(1, kEpoch, &kNs, &gens);
  ASSERT_TRUE(b_->Free(again, kEpoch).ok());
  s = RecvBlockInPlace(in, *b_, again[0], kEpoch, gens[0], "dst_blocks[0]", kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
}

TEST_F(BlockStreamTest, SilenceAndAClosedPeerFailTheReceive) {
  DataConn in(pair_.receiver());
  absl::Status s =
      RecvBlockInPlace(in, *b_, into_[0], kEpoch, 0, "dst_blocks[0]", absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  shutdown(pair_.sender(), SHUT_WR);
  s = RecvBlockInPlace(in, *b_, into_[0], kEpoch, 0, "dst_blocks[0]", kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST_F(BlockStreamTest, APeerThatStopsReadingFailsTheSend) {
  DataConn out(pair_.sender());
  bool answerable = true;
  absl::Status s = SendCommittedBlockInPlace(out, *a_, from_[0], kNs, Page(0), "block_ids[0]",
                                             absl::Milliseconds(100), &answerable);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_FALSE(answerable);
}

}  // namespace
}  // namespace kvcm
