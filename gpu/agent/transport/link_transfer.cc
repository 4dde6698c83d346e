#include "gpu/agent/transport/link_transfer.h"

#include <algorithm>
#include <vector>

#include "absl/base/internal/endian.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu/agent/transport/block_stream.h"
#include "gpu/agent/transport/data_socket.h"

namespace kvcm {

absl::StatusOr<uint32_t> LinkChunkBlocks(uint64_t block_bytes, uint64_t link_staging_bytes,
                                         uint64_t puller_chunk_bytes) {
  const uint64_t limit = puller_chunk_bytes == 0 ? link_staging_bytes
                                                 : std::min(link_staging_bytes, puller_chunk_bytes);
  const uint64_t blocks = block_bytes == 0 ? 0 : limit / block_bytes;
  if (blocks == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a chunk of ", limit, " bytes (link staging ", link_staging_bytes, ", link_chunk_bytes ",
        puller_chunk_bytes, ") holds no block of ", block_bytes, " bytes"));
  }
  return static_cast<uint32_t>(std::min<uint64_t>(blocks, UINT32_MAX));
}

LinkTransferResult ServeOverLink(DataConn& conn, const BlockPool& pool, const NamespaceId& ns,
                                 std::span<const BlockId> ids, std::span<const PageHash> pages,
                                 uint32_t chunk_blocks, BlockLink& link, absl::Duration timeout) {
  const uint64_t block_bytes = pool.geometry().bytes_per_block();
  const BlockLink::WaitCheck peer_open = [&conn] { return CheckPeerOpen(conn); };
  for (size_t first = 0; first < ids.size(); first += chunk_blocks) {
    const size_t n = std::min<size_t>(chunk_blocks, ids.size() - first);
    for (size_t j = 0; j < n; ++j) {
      const size_t i = first + j;
      // The pool's lock is held for this block's copy into staging only.
      absl::Status staged = pool.WithCommittedBlock(
          ids[i], ns, pages[i], absl::StrCat("block_ids[", i, "]"), [&](const std::byte* block) {
            return link.StageIn(block, j * block_bytes, block_bytes);
          });
      if (!staged.ok()) {
        // Nothing of this chunk is on the link: the link stays usable.
        if (SendAll(conn, &kTagError, 1).ok()) (void)SendFrame(conn, HeaderOf(staged, block_bytes));
        return {staged, false};
      }
    }
    char announce[5];
    announce[0] = static_cast<char>(kTagLinkChunk);
    absl::little_endian::Store32(announce + 1, static_cast<uint32_t>(n));
    if (absl::Status s = SendAll(conn, announce, sizeof(announce)); !s.ok()) return {s, false};
    if (absl::Status s = link.Send(n * block_bytes, timeout, peer_open); !s.ok()) {
      return {s, true};
    }
  }
  uint8_t done = 0;
  if (absl::Status s = RecvAll(conn, &done, 1); !s.ok()) return {s, false};
  if (done != kTagDone) return {absl::DataLossError(absl::StrCat("unknown tag ", done)), false};
  return {absl::OkStatus(), false};
}

absl::StatusOr<uint64_t> ReceiveBlocks(DataConn& conn, const PullSpec& spec, BlockLink* link,
                                       absl::Duration timeout, bool* link_broken) {
  *link_broken = false;
  const uint64_t block_bytes = spec.dst->geometry().bytes_per_block();
  const BlockLink::WaitCheck peer_open = [&conn] { return CheckPeerOpen(conn); };
  const bool in_place = CanRecvInPlace(*spec.dst);
  std::vector<std::byte> socket_staging;  // when not in place
  bool used_link = false;
  size_t i = 0;
  while (i < spec.peer_blocks.size()) {
    uint8_t tag = 0;
    if (absl::Status s = RecvAll(conn, &tag, 1); !s.ok()) return s;
    if (tag == kTagError) {
      v1::PullBlocksHeader header;
      if (absl::Status s = RecvFrame(conn, &header); !s.ok()) return s;
      // A hostile or broken server may send code 0 here: not a result.
      if (absl::Status s = StatusOf(header); !s.ok()) return s;
      return absl::DataLossError(absl::StrCat("error tag at block ", i, " with an OK status"));
    }
    if (tag == kTagBlock && in_place) {
      if (absl::Status s =
              RecvBlockInPlace(conn, *spec.dst, spec.dst_blocks[i], spec.dst_owner_epoch,
                               spec.dst_generations.empty() ? 0 : spec.dst_generations[i],
                               absl::StrCat("dst_blocks[", i, "]"), timeout);
          !s.ok()) {
        return s;
      }
      ++i;
      continue;
    }
    if (tag == kTagBlock) {
      socket_staging.resize(block_bytes);
      if (absl::Status s = RecvAll(conn, socket_staging.data(), block_bytes); !s.ok()) return s;
      if (absl::Status s =
              spec.dst->WriteBlocks({&spec.dst_blocks[i], 1}, spec.dst_owner_epoch, socket_staging,
                                    spec.dst_generations.empty()
                                        ? std::span<const uint64_t>()
                                        : std::span<const uint64_t>(&spec.dst_generations[i], 1));
          !s.ok()) {
        return s;
      }
      ++i;
      continue;
    }
    if (tag != kTagLinkChunk || link == nullptr) {
      return absl::DataLossError(absl::StrCat("unknown tag ", tag));
    }
    char count[4];
    if (absl::Status s = RecvAll(conn, count, sizeof(count)); !s.ok()) return s;
    const uint32_t n = absl::little_endian::Load32(count);
    if (n == 0 || n > spec.peer_blocks.size() - i || n * block_bytes > link->staging_bytes()) {
      return absl::DataLossError(absl::StrCat("the server announced a chunk of ", n, " blocks at ",
                                              i, " of ", spec.peer_blocks.size()));
    }
    // The network wait: no pool lock is held.
    if (absl::Status s = link->Recv(n * block_bytes, timeout, peer_open); !s.ok()) {
      *link_broken = true;
      return s;
    }
    used_link = true;
    for (uint32_t j = 0; j < n; ++j, ++i) {
      // The pool's lock is held for this block's copy out of staging only.
      absl::Status s = spec.dst->WithWritableBlock(
          spec.dst_blocks[i], spec.dst_owner_epoch, absl::StrCat("dst_blocks[", i, "]"),
          [&](std::byte* block) -> absl::StatusOr<uint64_t> {
            KVCM_RETURN_IF_ERROR(link->StageOut(j * block_bytes, block, block_bytes));
            return block_bytes;
          },
          spec.dst_generations.empty() ? 0 : spec.dst_generations[i]);
      if (!s.ok()) return s;
    }
  }
  if (used_link) {
    if (absl::Status s = SendAll(conn, &kTagDone, 1); !s.ok()) return s;
    // The server closes once it has released its end of the link: waiting for that makes a
    // finished pull mean an idle link on both ends. Every byte arrived already, so how the
    // wait ends does not matter.
    uint8_t eof = 0;
    (void)RecvAll(conn, &eof, 1);
  }
  return block_bytes * spec.peer_blocks.size();
}

}  // namespace kvcm
