#include "gpu/agent/pool/inventory_report.h"

#include <algorithm>
#include <map>
#include <optional>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/page_hash.h"
#include "gpu/agent/pool/agent_state.h"
#include "proto/core_types.h"

namespace kvcm {

InventoryReport::InventoryReport(absl::string_view agent_id, uint64_t epoch, const BlockPool& pool,
                                 Tier tier, const BlockPool* host_pool, const NamespaceSpecs& specs,
                                 uint32_t max_blocks_per_chunk)
    : agent_id_(agent_id), epoch_(epoch), max_blocks_per_chunk_(max_blocks_per_chunk) {
  AddPool(pool, tier, specs);
  if (host_pool != nullptr) AddPool(*host_pool, Tier::kHost, specs);
  for (size_t g = 0; g < groups_.size(); ++g) {
    const size_t n = groups_[g].blocks.size();
    for (size_t begin = 0; begin < n; begin += max_blocks_per_chunk_) {
      chunks_.push_back({g, begin, std::min<size_t>(n, begin + max_blocks_per_chunk_)});
    }
    blocks_ += n;
  }
}

void InventoryReport::AddPool(const BlockPool& pool, Tier tier, const NamespaceSpecs& specs) {
  // By (tenant, model), so that the stream's order does not depend on hashing.
  std::map<std::pair<std::string, std::string>, std::vector<CommittedBlock>> by_ns;
  for (const CommittedBlock& b : pool.Inventory()) {
    by_ns[{b.ns->tenant, b.ns->model}].push_back(b);
  }
  for (auto& [key, blocks] : by_ns) {
    NamespaceId ns{key.first, key.second};
    std::optional<ModelSpec> spec = specs.Get(ns);
    if (!spec.has_value()) {
      skipped_blocks_ += blocks.size();
      skipped_namespaces_.push_back(std::move(ns));
      continue;
    }
    const uint32_t max_page_age_s = specs.MaxPageAgeS(ns);
    groups_.push_back({.tier = tier,
                       .ns = std::move(ns),
                       .spec = *spec,
                       .max_page_age_s = max_page_age_s,
                       .blocks = std::move(blocks)});
  }
}

v1::InventoryChunk InventoryReport::Chunk(size_t i) const {
  const ChunkRef& ref = chunks_[i];
  const Group& group = groups_[ref.group];
  v1::InventoryChunk chunk;
  chunk.set_agent_id(agent_id_);
  chunk.set_epoch(epoch_);
  chunk.set_tier(TierToProto(group.tier));
  NamespaceToProto(group.ns, chunk.mutable_namespace_());
  ModelSpecToProto(group.spec, chunk.mutable_spec());
  std::vector<PageHash> pages, parents;
  pages.reserve(ref.end - ref.begin);
  parents.reserve(ref.end - ref.begin);
  chunk.set_max_page_age_s(group.max_page_age_s);
  chunk.mutable_block_ids()->Reserve(static_cast<int>(ref.end - ref.begin));
  chunk.mutable_committed_unix_ms()->Reserve(static_cast<int>(ref.end - ref.begin));
  for (size_t b = ref.begin; b < ref.end; ++b) {
    chunk.add_block_ids(group.blocks[b].block);
    chunk.add_committed_unix_ms(group.blocks[b].committed_unix_ms);
    pages.push_back(group.blocks[b].page);
    parents.push_back(group.blocks[b].parent);
  }
  chunk.set_page_hashes(EncodePageHashes(pages));
  chunk.set_parent_hashes(EncodePageHashes(parents));
  return chunk;
}

InventoryFreeResult FreeInventoryRefusals(const v1::InventoryReply& reply, uint64_t epoch,
                                          BlockPool& pool, Tier tier, BlockPool* host_pool) {
  InventoryFreeResult result;
  auto refuse = [&](uint64_t blocks, absl::Status status) {
    result.refused_blocks += blocks;
    if (result.first_error.ok()) result.first_error = std::move(status);
  };
  for (const v1::PoolBlocks& list : reply.to_free()) {
    if (list.block_ids_size() == 0) continue;
    BlockPool* target = AgentPools{.main = &pool, .host = host_pool}.ForWireTier(tier, list.tier());
    if (target == nullptr) {
      refuse(list.block_ids_size(),
             absl::InvalidArgumentError(absl::StrCat("to_free.tier ", static_cast<int>(list.tier()),
                                                     " is not a pool of this agent")));
      continue;
    }
    const std::span<const BlockId> ids(list.block_ids().data(), list.block_ids_size());
    if (target->FreeCommitted(ids, epoch, "to_free.block_ids").ok()) {
      result.freed_blocks += ids.size();
      continue;
    }
    for (const BlockId id : ids) {
      if (absl::Status s = target->FreeCommitted({&id, 1}, epoch, "to_free.block_ids"); s.ok()) {
        ++result.freed_blocks;
      } else {
        refuse(1, std::move(s));
      }
    }
  }
  return result;
}

}  // namespace kvcm
