// Access control of BlockAgent: what an authenticated caller (common/authenticator.h) may do
// with this agent's blocks. Every BlockAgent handler, the streams included, authenticates and
// then calls one of these before it validates or touches anything, so a refused call changes
// nothing.
//
//   agent, admin  everything (peers pull, operators inspect);
//   worker        Allocate in its tenant's namespaces; Free, WriteBlocks, ReadBlocks,
//                 RunAttention and Fetch only over blocks allocated to (or committed in) its
//                 tenant's namespaces, every block checked before any is used;
//   router        Stats only; any authenticated caller may call Stats.
//
// Each returns OK or PERMISSION_DENIED naming the principal and the first block or namespace
// it may not use, never who holds that block (a free block, one allocated without a
// namespace and one of another tenant get the same answer). A free block and one allocated
// without a namespace belong to no tenant: only agents and admins may name them.
//
// Block generations (block_ledger.h): authorization binds each block to the generation it
// has now, in the same critical section as the tenant check (and checks the caller's own
// generations there first: ABORTED for an allocation that ended); the call then does all its
// work, every stream chunk included, with the bound generations, so it can only ever touch
// the allocations that passed. A worker must send generations with Free and WriteBlocks
// (RequireGenerations: the blocks it frees or writes are always its own allocations);
// ReadBlocks, RunAttention and Fetch take them optionally, as a Match's committed blocks
// come without one. Thread-safe.
#ifndef KVCM_GPU_AGENT_SERVER_BLOCK_AGENT_ACCESS_H_
#define KVCM_GPU_AGENT_SERVER_BLOCK_AGENT_ACCESS_H_

#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/token_table.h"
#include "common/types.h"
#include "gpu/agent/pool/block_pool.h"
#include "kvcm/v1/agent.pb.h"

namespace kvcm {

// Allocate: a worker only with a namespace of its tenant.
absl::Status AuthorizeAllocate(const Principal& p, const v1::AllocateBlocksRequest& req);

// A call that `what`s (e.g. "free blocks") the blocks `ids` of `pool`. A null pool (the agent
// has no pool of the requested tier) holds nobody's blocks: OK, and validation then refuses
// the tier.
// With `bound`, sets it to the generation of each block when it passed (0: a free block,
// which only agents and admins pass), parallel to `ids`.
absl::Status AuthorizeBlocks(const Principal& p, const BlockPool* pool,
                             std::span<const BlockId> ids, absl::string_view what,
                             std::span<const uint64_t> generations = {},
                             std::vector<uint64_t>* bound = nullptr);

// INVALID_ARGUMENT naming `field` unless `generations` holds one non-zero generation per
// id, or is empty and `p` is an agent or admin (who may leave them out).
absl::Status RequireGenerations(const Principal& p, size_t num_ids,
                                std::span<const uint64_t> generations, absl::string_view field);

// Fetch into `pool` (the pool req.tier names; may be null): a worker of req.namespace's
// tenant whose local_block_ids are blocks of its tenant.
absl::Status AuthorizeFetch(const Principal& p, const BlockPool* pool, const v1::FetchRequest& req);

// RunAttention over `pool`'s blocks in every row of req.block_table; with `bound`, the
// generations each row's blocks passed in (AuthorizeBlocks).
absl::Status AuthorizeRunAttention(const Principal& p, const BlockPool& pool,
                                   const v1::RunAttentionRequest& req,
                                   std::vector<std::vector<uint64_t>>* bound = nullptr);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_SERVER_BLOCK_AGENT_ACCESS_H_
