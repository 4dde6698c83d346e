#include "server/service/inventory_stream.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "server/core/inventory_restore.h"
#include "server/service/proto_convert.h"

namespace kvcm {
namespace {

constexpr size_t kHashBytes = 16;

absl::Status Invalid(absl::string_view what) { return absl::InvalidArgumentError(what); }

// gRPC runs at most one reaction of a call at a time, and OnDone last, so the reactor
// needs no lock.
class InventoryReactor final : public grpc::ServerReadReactor<v1::InventoryChunk> {
 public:
  InventoryReactor(CacheIndex* index, const AgentRegistry* agents, RpcRunner<Rpc>* rpc,
                   v1::InventoryReply* reply)
      : index_(index), agents_(agents), rpc_(rpc), reply_(reply) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    const absl::Status status = ok ? Take() : Restore();
    if (ok && status.ok()) {
      StartRead(&chunk_);
      return;
    }
    // A failed chunk ends the call at once: what was collected is dropped.
    Finish(rpc_->StreamEnd(Rpc::kReportInventory, status));
  }

  void OnDone() override { delete this; }

 private:
  // Checks and collects chunk_.
  absl::Status Take() {
    if (!collector_.has_value()) {
      if (absl::Status s = Begin(); !s.ok()) return s;
    } else if (chunk_.agent_id() != agent_id_ || chunk_.epoch() != epoch_) {
      return Invalid(absl::StrCat("agent_id and epoch must be the same in every chunk (", agent_id_,
                                  " epoch ", epoch_, ")"));
    }
    const int n = chunk_.block_ids_size();
    if (n > kMaxInventoryChunkBlocks) {
      return Invalid(absl::StrCat("block_ids has ", n, " entries; at most ",
                                  kMaxInventoryChunkBlocks, " per chunk"));
    }
    for (absl::string_view field : {"page_hashes", "parent_hashes"}) {
      const std::string& bytes =
          field == "page_hashes" ? chunk_.page_hashes() : chunk_.parent_hashes();
      if (bytes.size() != kHashBytes * n) {
        return Invalid(absl::StrCat(field, " has ", bytes.size(), " bytes, expected 16 per block (",
                                    kHashBytes * n, ")"));
      }
    }
    absl::StatusOr<NamespaceId> ns =
        NamespaceFromProto(chunk_.has_namespace_() ? &chunk_.namespace_() : nullptr, "namespace");
    if (!ns.ok()) return ns.status();
    absl::StatusOr<ModelSpec> spec =
        ModelSpecFromProto(chunk_.has_spec() ? &chunk_.spec() : nullptr);
    if (!spec.ok()) return spec.status();
    const std::vector<PageHash> pages = DecodePageHashes(chunk_.page_hashes());
    const std::vector<PageHash> parents = DecodePageHashes(chunk_.parent_hashes());
    std::vector<InventoryPage> entries(n);
    for (int i = 0; i < n; ++i) {
      entries[i] =
          InventoryPage{.block = chunk_.block_ids(i), .page = pages[i], .parent = parents[i]};
    }
    return collector_->Add(static_cast<Tier>(chunk_.tier()), *ns, *spec, std::move(entries));
  }

  // The first chunk: the agent must be registered in this epoch; its pools are noted with
  // their generations, so that a re-registration during the stream is noticed.
  absl::Status Begin() {
    agent_id_ = chunk_.agent_id();
    epoch_ = chunk_.epoch();
    if (absl::Status s = ValidateAgentId(agent_id_, "agent_id"); !s.ok()) return s;
    if (absl::Status s = agents_->CheckLive(agent_id_, epoch_); !s.ok()) return s;
    std::vector<InventoryCollector::Pool> pools;
    uint64_t bytes_per_block = 0;
    for (Tier tier : {Tier::kGpu, Tier::kHost, Tier::kDisk}) {
      const PoolKey key{agent_id_, tier};
      std::optional<AgentPool> pool = agents_->FindPool(key);
      if (!pool.has_value() || pool->epoch != epoch_) continue;
      absl::StatusOr<uint64_t> generation = index_->PoolGeneration(key);
      if (!generation.ok()) continue;
      bytes_per_block = pool->bytes_per_block;
      pools.push_back({.tier = tier, .num_blocks = pool->num_blocks, .generation = *generation});
    }
    if (pools.empty()) {
      return absl::AbortedError(
          absl::StrCat("agent ", agent_id_, " epoch ", epoch_, " has no pool; register again"));
    }
    collector_.emplace(agent_id_, bytes_per_block, std::move(pools));
    return absl::OkStatus();
  }

  // The agent closed the stream: restore everything it sent.
  absl::Status Restore() {
    if (!collector_.has_value()) return absl::OkStatus();  // an empty inventory
    // The epoch may have ended while the chunks came; the pool generations catch a
    // re-registration that happens during the restore itself.
    if (absl::Status s = agents_->CheckLive(agent_id_, epoch_); !s.ok()) return s;
    absl::StatusOr<InventoryOutcome> outcome = collector_->Restore(*index_);
    if (!outcome.ok()) return outcome.status();
    reply_->set_indexed_pages(outcome->indexed_pages);
    reply_->set_orphan_pages(outcome->orphan_pages);
    reply_->set_duplicate_pages(outcome->duplicate_pages);
    reply_->set_refused_pages(outcome->refused_pages);
    for (const auto& [tier, blocks] : outcome->to_free) {
      if (blocks.empty()) continue;
      v1::PoolBlocks* free = reply_->add_to_free();
      free->set_tier(static_cast<v1::Tier>(tier));
      free->mutable_block_ids()->Add(blocks.begin(), blocks.end());
    }
    LogInfo(absl::StrCat("agent ", agent_id_, " epoch ", epoch_, ": inventory of ",
                         collector_->pages(), " committed blocks; indexed ", outcome->indexed_pages,
                         ", orphans ", outcome->orphan_pages, ", duplicates ",
                         outcome->duplicate_pages, ", refused ", outcome->refused_pages));
    return absl::OkStatus();
  }

  CacheIndex* const index_;
  const AgentRegistry* const agents_;
  RpcRunner<Rpc>* const rpc_;
  v1::InventoryReply* const reply_;
  v1::InventoryChunk chunk_;
  std::string agent_id_;
  uint64_t epoch_ = 0;
  std::optional<InventoryCollector> collector_;
};

}  // namespace

grpc::ServerReadReactor<v1::InventoryChunk>* OpenInventoryStream(CacheIndex* index,
                                                                 const AgentRegistry* agents,
                                                                 RpcRunner<Rpc>* rpc,
                                                                 v1::InventoryReply* reply) {
  return new InventoryReactor(index, agents, rpc, reply);
}

}  // namespace kvcm
