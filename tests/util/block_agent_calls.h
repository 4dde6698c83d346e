// BlockAgent calls through a stub, as a worker makes them: allocate blocks for a namespace,
// free them, write and read their bytes. For the in-process and the multi-process tests
// alike (nothing here starts a server). Header-only, test code.
#ifndef KVCM_TESTS_UTIL_BLOCK_AGENT_CALLS_H_
#define KVCM_TESTS_UTIL_BLOCK_AGENT_CALLS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "proto/core_types.h"

namespace kvcm::testing {

// BlockAgent.Allocate of `count` blocks for `owner_epoch` in namespace `ns`: blocks that can
// be committed to pages of `ns` when owner_epoch is the agent's epoch. The call's status;
// the ids are appended to *ids and, with `generations`, their generations to it.
inline grpc::Status AllocateTo(v1::BlockAgent::Stub& agent, uint32_t count, uint64_t owner_epoch,
                               const NamespaceId& ns, std::vector<BlockId>* ids,
                               std::vector<uint64_t>* generations = nullptr) {
  v1::AllocateBlocksRequest req;
  req.set_count(count);
  req.set_owner_epoch(owner_epoch);
  NamespaceToProto(ns, req.mutable_namespace_());
  v1::AllocateBlocksResponse resp;
  grpc::ClientContext ctx;
  const grpc::Status status = agent.Allocate(&ctx, req, &resp);
  if (status.ok()) ids->insert(ids->end(), resp.block_ids().begin(), resp.block_ids().end());
  if (status.ok() && generations != nullptr) {
    generations->insert(generations->end(), resp.block_generations().begin(),
                        resp.block_generations().end());
  }
  return status;
}

// Writes blocks `ids` whole with zeros (the agent's Stats give the block size): what a
// worker's blocks are after it wrote its KV, ready to insert (the agent commits a block
// only once all its bytes were written). A failed call is a test failure (EXPECT).
inline void WriteZeros(v1::BlockAgent::Stub& agent, std::span<const BlockId> ids,
                       uint64_t owner_epoch, std::span<const uint64_t> generations = {});

// AllocateTo, then WriteZeros: blocks ready to insert. A failed call is a test failure
// (EXPECT) and returns no blocks.
inline std::vector<BlockId> AllocateIn(v1::BlockAgent::Stub& agent, uint32_t count,
                                       uint64_t owner_epoch, const NamespaceId& ns) {
  std::vector<BlockId> ids;
  std::vector<uint64_t> generations;
  const grpc::Status status = AllocateTo(agent, count, owner_epoch, ns, &ids, &generations);
  EXPECT_TRUE(status.ok()) << status.error_message();
  if (status.ok()) WriteZeros(agent, ids, owner_epoch, generations);
  return ids;
}

// BlockAgent.Free, as the worker that allocated the blocks (with their generations: a
// worker's Free needs them).
inline grpc::Status FreeAsWorker(v1::BlockAgent::Stub& agent, std::span<const BlockId> ids,
                                 uint64_t owner_epoch, std::span<const uint64_t> generations = {}) {
  v1::FreeBlocksRequest req;
  req.mutable_block_ids()->Add(ids.begin(), ids.end());
  req.mutable_block_generations()->Add(generations.begin(), generations.end());
  req.set_owner_epoch(owner_epoch);
  v1::FreeBlocksResponse resp;
  grpc::ClientContext ctx;
  return agent.Free(&ctx, req, &resp);
}

// BlockAgent.WriteBlocks of `bytes` (block_ids x the block size) into `ids` (of
// `generations`: a worker's write needs them).
inline grpc::Status WriteAll(v1::BlockAgent::Stub& agent, std::span<const BlockId> ids,
                             uint64_t owner_epoch, const std::string& bytes,
                             std::span<const uint64_t> generations = {}) {
  grpc::ClientContext ctx;
  v1::WriteBlocksResponse resp;
  auto writer = agent.WriteBlocks(&ctx, &resp);
  v1::WriteBlocksRequest header;
  header.mutable_header()->mutable_block_ids()->Add(ids.begin(), ids.end());
  header.mutable_header()->set_owner_epoch(owner_epoch);
  header.mutable_header()->mutable_block_generations()->Add(generations.begin(), generations.end());
  bool sent = writer->Write(header);
  for (size_t off = 0; sent && off < bytes.size(); off += 1 << 20) {
    v1::WriteBlocksRequest chunk;
    chunk.set_data(bytes.substr(off, 1 << 20));
    sent = writer->Write(chunk);
  }
  writer->WritesDone();
  return writer->Finish();
}

inline void WriteZeros(v1::BlockAgent::Stub& agent, std::span<const BlockId> ids,
                       uint64_t owner_epoch, std::span<const uint64_t> generations) {
  v1::BlockAgentStatsResponse stats;
  grpc::ClientContext ctx;
  const grpc::Status got = agent.Stats(&ctx, v1::BlockAgentStatsRequest(), &stats);
  ASSERT_TRUE(got.ok()) << got.error_message();
  const std::string zeros(ids.size() * stats.geometry().bytes_per_block(), '\0');
  const grpc::Status wrote = WriteAll(agent, ids, owner_epoch, zeros, generations);
  EXPECT_TRUE(wrote.ok()) << wrote.error_message();
}

// BlockAgent.ReadBlocks of `ids` (of `generations`, optional) from the pool of `tier`.
inline absl::StatusOr<std::string> ReadAll(v1::BlockAgent::Stub& agent,
                                           std::span<const BlockId> ids, uint64_t owner_epoch,
                                           v1::Tier tier = v1::TIER_UNSPECIFIED,
                                           std::span<const uint64_t> generations = {}) {
  v1::ReadBlocksRequest read;
  read.mutable_block_ids()->Add(ids.begin(), ids.end());
  read.mutable_block_generations()->Add(generations.begin(), generations.end());
  read.set_owner_epoch(owner_epoch);
  read.set_tier(tier);
  grpc::ClientContext ctx;
  auto reader = agent.ReadBlocks(&ctx, read);
  std::string got;
  v1::ReadBlocksResponse chunk;
  while (reader->Read(&chunk)) got += chunk.data();
  const grpc::Status status = reader->Finish();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  return got;
}

// A BlockAgent.Fetch of prompt `pages` of `ns` (hashed with the namespace key whose
// fingerprint is `key_fingerprint`, `page_size_tokens` per page) from `source_blocks` of
// agent `source_agent_id`.
inline v1::FetchRequest FetchRequestFor(const NamespaceId& ns, std::span<const PageHash> pages,
                                        uint32_t page_size_tokens, uint64_t key_fingerprint,
                                        const std::string& source_agent_id,
                                        std::span<const BlockId> source_blocks) {
  v1::FetchRequest req;
  NamespaceToProto(ns, req.mutable_namespace_());
  req.mutable_prompt()->set_page_hashes(EncodePageHashes(pages));
  v1::HashScheme* scheme = req.mutable_prompt()->mutable_scheme();
  scheme->set_version(kPageHashVersion);
  scheme->set_page_size_tokens(page_size_tokens);
  scheme->set_key_fingerprint(key_fingerprint);
  req.set_source_agent_id(source_agent_id);
  req.mutable_source_block_ids()->Add(source_blocks.begin(), source_blocks.end());
  return req;
}

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_BLOCK_AGENT_CALLS_H_
