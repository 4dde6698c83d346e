// The data port (agent.proto, above PullBlocksRequest) as a hostile peer drives it, over a
// socket pair whose other end holds the input and then closes:
//   byte 0 even: the serving side. The peer is a puller: its bytes are the request frame
//     (RecvFrame), checked by CheckPullRequest against the AgentWorld's pools, then every
//     block read as TcpTransport's Serve reads it (committed to the page named).
//   byte 0 odd: the pulling side. The peer is a server: its bytes are the header frame
//     (StatusOf, the block size check) and then the tagged blocks ReceiveBlocks takes into
//     freshly allocated blocks, as TcpTransport's PullOn does.
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/agent_world.h"
#include "fuzz/fuzz_input.h"
#include "gpu/agent/transport/data_socket.h"
#include "gpu/agent/transport/link_transfer.h"
#include "gpu/agent/transport/tcp/tcp_transport.h"

namespace kvcm::fuzz {
namespace {

// Larger inputs would fill the socket buffer before anyone reads.
constexpr size_t kMaxPeerBytes = 64 << 10;
constexpr uint32_t kIoTimeoutMs = 1000;

// TcpTransport's Serve, up to the socket writes (the blocks are read, not sent).
void Serve(const AgentWorld& world, int fd) {
  DataConn conn(fd);
  v1::PullBlocksRequest req;
  if (!RecvFrame(conn, &req).ok()) return;
  const BlockPool* pool = world.pools.ForWireTier(world.options.tier, req.tier());
  absl::StatusOr<NamespaceId> ns = CheckPullRequest(req, pool);
  if (!ns.ok()) return;
  const std::vector<PageHash> pages = DecodePageHashes(req.page_hashes());
  Require(pages.size() == static_cast<size_t>(req.block_ids_size()), "one page per block");
  std::vector<std::byte> staging(pool->geometry().bytes_per_block());
  for (int i = 0; i < req.block_ids_size(); ++i) {
    if (!pool->ReadCommittedBlock(req.block_ids(i), *ns, pages[i], staging,
                                  absl::StrCat("block_ids[", i, "]"))
             .ok()) {
      return;
    }
  }
}

// TcpTransport's PullOn after it sent its request: four committed pages pulled into four
// fresh blocks of the main pool.
void Pull(AgentWorld& world, int fd) {
  DataConn conn(fd);
  PullSpec spec{.peer_address = "127.0.0.1:1",
                .ns = AgentNamespace(),
                .peer_blocks = {0, 1, 2, 3},
                .dst = world.pools.main,
                .dst_owner_epoch = world.owner_epoch};
  for (int i = 0; i < 4; ++i) spec.pages.push_back(CommittedPage(i));
  absl::StatusOr<std::vector<BlockId>> dst = world.main->Allocate(4, world.owner_epoch, nullptr);
  Require(dst.ok(), "allocate pull destination");
  spec.dst_blocks = *dst;
  v1::PullBlocksHeader header;
  if (!RecvFrame(conn, &header).ok() || !StatusOf(header).ok()) return;
  if (header.bytes_per_block() != spec.dst->geometry().bytes_per_block()) return;
  bool broken = false;
  absl::StatusOr<uint64_t> got =
      ReceiveBlocks(conn, spec, /*link=*/nullptr, absl::Milliseconds(kIoTimeoutMs), &broken);
  Require(!got.ok() || *got == 4 * spec.dst->geometry().bytes_per_block(),
          "a complete pull received every byte");
}

}  // namespace
}  // namespace kvcm::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcm::fuzz;
  if (size < 1 || size - 1 > kMaxPeerBytes) return 0;
  int fds[2];
  Require(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0, "socketpair");
  const int ours = fds[0];
  const int peer = fds[1];
  kvcm::SetSocketOptions(ours, kIoTimeoutMs);
  int buffer = static_cast<int>(2 * kMaxPeerBytes);
  setsockopt(peer, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
  setsockopt(ours, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
  kvcm::DataConn peer_conn(peer);
  Require(kvcm::SendAll(peer_conn, data + 1, size - 1).ok(), "peer bytes");
  shutdown(peer, SHUT_WR);
  {
    AgentWorld world;
    if (data[0] % 2 == 0) {
      Serve(world, ours);
    } else {
      Pull(world, ours);
    }
  }
  close(ours);
  close(peer);
  return 0;
}
