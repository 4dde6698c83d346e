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
// Block generations (block_ledger.h): a worker must name, with every block, the generation
// Allocate gave it (INVALID_ARGUMENT naming the field otherwise); agents and admins may
// leave them out (then only the owner epoch is checked, as before). The generations are
// checked in the same critical section as the tenant, first (ABORTED for an allocation that
// ended), so a (block, generation) pair once authorized always names that allocation.
// Thread-safe.
#ifndef KVCM_GPU_AGENT_BLOCK_AGENT_ACCESS_H_
#define KVCM_GPU_AGENT_BLOCK_AGENT_ACCESS_H_

#include <span>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/token_table.h"
#include "common/types.h"
#include "gpu/agent/block_pool.h"
#include "kvcm/v1/agent.pb.h"

namespace kvcm {

// Allocate: a worker only with a namespace of its tenant.
absl::Status AuthorizeAllocate(const Principal& p, const v1::AllocateBlocksRequest& req);

// A call that `what`s (e.g. "free blocks") the blocks `ids` of `pool`. A null pool (the agent
// has no pool of the requested tier) holds nobody's blocks: OK, and validation then refuses
// the tier.
absl::Status AuthorizeBlocks(const Principal& p, const BlockPool* pool,
                             std::span<const BlockId> ids, absl::string_view what,
                             std::span<const uint64_t> generations = {});

// INVALID_ARGUMENT naming `field` unless `generations` holds one generation per id, or is
// empty and `p` is an agent or admin (who may leave them out).
absl::Status RequireGenerations(const Principal& p, size_t num_ids,
                                std::span<const uint64_t> generations, absl::string_view field);

// Fetch into `pool` (the pool req.tier names; may be null): a worker of req.namespace's
// tenant whose local_block_ids are blocks of its tenant.
absl::Status AuthorizeFetch(const Principal& p, const BlockPool* pool, const v1::FetchRequest& req);

// RunAttention over `pool`'s blocks in every row of req.block_table.
absl::Status AuthorizeRunAttention(const Principal& p, const BlockPool& pool,
                                   const v1::RunAttentionRequest& req);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_BLOCK_AGENT_ACCESS_H_
