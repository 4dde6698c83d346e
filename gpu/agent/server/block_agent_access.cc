#include "gpu/agent/server/block_agent_access.h"

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

absl::Status Denied(const Principal& p, absl::string_view what) {
  return absl::PermissionDeniedError(
      absl::StrCat("principal ", p.name, " (roles ", RoleNames(p.roles), ") may not ", what));
}

// Agents (peers) and admins may do everything.
bool MayDoAll(const Principal& p) { return p.Has(Role::kAgent) || p.Has(Role::kAdmin); }

}  // namespace

absl::Status AuthorizeAllocate(const Principal& p, const v1::AllocateBlocksRequest& req) {
  if (MayDoAll(p)) return absl::OkStatus();
  if (!req.has_namespace_()) {
    return Denied(p, "allocate blocks without a namespace (roles agent or admin)");
  }
  if (p.IsWorkerOf(req.namespace_().tenant())) return absl::OkStatus();
  return Denied(p, absl::StrCat("allocate blocks in tenant \"", req.namespace_().tenant(),
                                "\"'s namespaces"));
}

absl::Status AuthorizeBlocks(const Principal& p, const BlockPool* pool,
                             std::span<const BlockId> ids, absl::string_view what,
                             std::span<const uint64_t> generations, std::vector<uint64_t>* bound) {
  if (MayDoAll(p)) {
    if (pool == nullptr) return absl::OkStatus();
    return pool->CheckNamespaces(
        ids, [](BlockId, const NamespaceId*) { return absl::OkStatus(); }, generations, bound);
  }
  if (!p.Has(Role::kWorker))
    return Denied(p, absl::StrCat(what, " (roles worker, agent or admin)"));
  if (pool == nullptr) return absl::OkStatus();
  return pool->CheckNamespaces(
      ids,
      [&](BlockId id, const NamespaceId* ns) -> absl::Status {
        if (ns != nullptr && p.IsWorkerOf(ns->tenant)) return absl::OkStatus();
        // One answer for a free block, a private one and another tenant's: who holds a
        // block is not the caller's business.
        return Denied(p, absl::StrCat(what, ": block ", id,
                                      " is not allocated to a namespace of its tenant"));
      },
      generations, bound);
}

absl::Status RequireGenerations(const Principal& p, size_t num_ids,
                                std::span<const uint64_t> generations, absl::string_view field) {
  // Agents and admins may leave them out; callers that are not workers are refused by
  // their authorization, which says so better.
  if (generations.empty() && (MayDoAll(p) || !p.Has(Role::kWorker))) return absl::OkStatus();
  if (generations.size() == num_ids) {
    for (size_t i = 0; i < generations.size(); ++i) {
      if (generations[i] == 0 && !MayDoAll(p)) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, "[", i, "] is 0; send the generation Allocate returned for the block"));
      }
    }
    return absl::OkStatus();
  }
  if (generations.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field,
                     " is required: one generation per block id, as Allocate returned "
                     "them (principal ",
                     p.name, " is a worker)"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": ", generations.size(), " generations for ", num_ids, " block ids (one per id)"));
}

absl::Status AuthorizeFetch(const Principal& p, const BlockPool* pool,
                            const v1::FetchRequest& req) {
  // An agent's or admin's Fetch passes the tenant check, not the generations it gives: they
  // bind every caller (FetchRequest.local_block_generations).
  if (!MayDoAll(p) && !p.IsWorkerOf(req.namespace_().tenant())) {
    return Denied(
        p, absl::StrCat("fetch into tenant \"", req.namespace_().tenant(), "\"'s namespaces"));
  }
  return AuthorizeBlocks(
      p, pool, std::span<const BlockId>(req.local_block_ids().data(), req.local_block_ids_size()),
      "fetch",
      std::span<const uint64_t>(req.local_block_generations().data(),
                                req.local_block_generations_size()));
}

absl::Status AuthorizeRunAttention(const Principal& p, const BlockPool& pool,
                                   const v1::RunAttentionRequest& req,
                                   std::vector<std::vector<uint64_t>>* bound) {
  if (!MayDoAll(p) && !p.Has(Role::kWorker)) {
    return Denied(p, "run attention (roles worker, agent or admin)");
  }
  if (bound != nullptr) bound->clear();
  for (const v1::BlockList& row : req.block_table()) {
    std::vector<uint64_t> row_bound;
    if (absl::Status s = AuthorizeBlocks(
            p, &pool, std::span<const BlockId>(row.block_ids().data(), row.block_ids_size()),
            "run attention",
            std::span<const uint64_t>(row.block_generations().data(), row.block_generations_size()),
            &row_bound);
        !s.ok()) {
      return s;
    }
    if (bound != nullptr) bound->push_back(std::move(row_bound));
  }
  return absl::OkStatus();
}

}  // namespace kvcm
