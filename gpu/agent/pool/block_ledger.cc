#include "gpu/agent/pool/block_ledger.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcm {

BlockLedger::BlockLedger(uint32_t num_blocks, uint64_t first_generation)
    : slots_(num_blocks),
      next_generation_(
          first_generation != 0
              ? first_generation
              : std::max<uint64_t>(1, static_cast<uint64_t>(absl::GetCurrentTimeNanos()))) {
  for (BlockId id = 0; id < num_blocks; ++id) free_.push_back(id);
}

absl::StatusOr<std::vector<BlockId>> BlockLedger::Allocate(
    uint32_t count, uint64_t owner_epoch, const NamespaceId* ns, std::vector<uint64_t>* generations,
    std::vector<BlockId>* scrub, int64_t now_unix_ms, absl::string_view allocator) {
  if (count == 0) return absl::InvalidArgumentError("count must be >= 1");
  if (owner_epoch == 0) return absl::InvalidArgumentError("owner_epoch must be >= 1");
  if (count > free_.size()) {
    return absl::ResourceExhaustedError(absl::StrCat("asked for ", count, " blocks, ", free_.size(),
                                                     " of ", slots_.size(), " are free"));
  }
  const uint32_t ns_index = ns != nullptr ? Intern(*ns) : kNoNamespace;
  uint32_t principal = kNoPrincipal;
  if (!allocator.empty()) {
    auto [it, inserted] = principal_index_.try_emplace(allocator, principals_.size());
    if (inserted) principals_.emplace_back(allocator);
    principal = it->second;
  }
  std::vector<BlockId> out(free_.begin(), free_.begin() + count);
  free_.erase(free_.begin(), free_.begin() + count);
  if (generations != nullptr) generations->clear();
  if (scrub != nullptr) scrub->clear();
  for (BlockId id : out) {
    if (scrub != nullptr && slots_[id].last_ns != ns_index) scrub->push_back(id);
    slots_[id] = Slot{.state = State::kAllocated,
                      .ns = ns_index,
                      .owner_epoch = owner_epoch,
                      .allocated_unix_ms = now_unix_ms,
                      .generation = next_generation_++,
                      .allocator = principal};
    if (generations != nullptr) generations->push_back(slots_[id].generation);
  }
  return out;
}

absl::Status BlockLedger::CheckList(std::span<const BlockId> ids, uint64_t epoch,
                                    absl::string_view field, absl::StatusCode past_pool) const {
  if (ids.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " must not be empty"));
  if (epoch == 0) return absl::InvalidArgumentError("owner_epoch must be >= 1");
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= slots_.size()) {
      return absl::Status(past_pool,
                          absl::StrCat(field, "[", i, "]: block ", ids[i], " is past the pool of ",
                                       slots_.size(), " blocks"));
    }
  }
  // (id, index) pairs: a repeated id is reported with the index of its second occurrence.
  std::vector<std::pair<BlockId, size_t>> sorted(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) sorted[i] = {ids[i], i};
  std::sort(sorted.begin(), sorted.end());
  auto same_id = [](const auto& a, const auto& b) { return a.first == b.first; };
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end(), same_id); dup != sorted.end()) {
    return absl::InvalidArgumentError(absl::StrCat(field, "[", dup[1].second, "] lists block ",
                                                   dup->first, " twice (first at [", dup->second,
                                                   "])"));
  }
  return absl::OkStatus();
}

absl::Status BlockLedger::Free(std::span<const BlockId> ids, uint64_t owner_epoch,
                               std::span<const uint64_t> generations) {
  if (absl::Status s = CheckList(ids, owner_epoch, "block_ids", absl::StatusCode::kOutOfRange);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckGenerations(ids, generations, "block_ids"); !s.ok()) return s;
  for (BlockId id : ids) {
    const Slot& slot = slots_[id];
    switch (slot.state) {
      case State::kFree:
        return absl::FailedPreconditionError(
            absl::StrCat("block_ids: block ", id, " is not allocated (double free?)"));
      case State::kCommitted:
        return absl::FailedPreconditionError(
            absl::StrCat("block_ids: block ", id,
                         " is committed to the cache; the manager frees it when it evicts it"));
      case State::kAllocated:
        if (slot.owner_epoch != owner_epoch) {
          return absl::AbortedError(absl::StrCat("block_ids: block ", id,
                                                 " belongs to owner epoch ", slot.owner_epoch,
                                                 ", not ", owner_epoch));
        }
        break;
    }
  }
  for (BlockId id : ids) MakeFree(id);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<BlockId>> BlockLedger::Commit(const NamespaceId& ns, uint64_t epoch,
                                                         std::span<const CommitEntry> entries,
                                                         absl::string_view field,
                                                         int64_t committed_unix_ms,
                                                         const CommitChecks& checks) {
  std::vector<BlockId> ids;
  ids.reserve(entries.size());
  for (const CommitEntry& e : entries) ids.push_back(e.block);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == kPendingBlock) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "]: block ", kPendingBlock, " is reserved (pending)"));
    }
  }
  if (absl::Status s = CheckList(ids, epoch, field, absl::StatusCode::kInvalidArgument); !s.ok()) {
    return s;
  }
  auto it = namespace_index_.find(ns);
  const uint32_t ns_index = it == namespace_index_.end() ? kNoNamespace : it->second;
  std::vector<BlockId> fresh;
  for (size_t i = 0; i < entries.size(); ++i) {
    const CommitEntry& e = entries[i];
    const Slot& slot = slots_[e.block];
    const std::string where = absl::StrCat(field, "[", i, "]: block ", e.block);
    if (slot.state == State::kFree) {
      return absl::FailedPreconditionError(absl::StrCat(where, " is not allocated"));
    }
    if (slot.owner_epoch != epoch) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, " belongs to owner epoch ", slot.owner_epoch, ", not the agent's ", epoch));
    }
    if (slot.ns != ns_index || ns_index == kNoNamespace) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, " is not allocated to namespace ", ns.ToString(),
          slot.ns == kNoNamespace ? " (allocated without a namespace)"
                                  : absl::StrCat(" but to ", namespaces_[slot.ns].ToString())));
    }
    if (slot.state == State::kCommitted) {
      if (slot.page != e.page || slot.parent != e.parent) {
        return absl::FailedPreconditionError(absl::StrCat(
            where, " already holds page ", slot.page.ToHex(), ", not ", e.page.ToHex()));
      }
      continue;  // the same commit again
    }
    if (!checks.committer.empty() && slot.allocator != kNoPrincipal &&
        principals_[slot.allocator] != checks.committer) {
      return absl::PermissionDeniedError(absl::StrCat(
          where, " was allocated by principal \"", principals_[slot.allocator], "\", not by \"",
          checks.committer, "\", whose insert names it: only a block's allocator may commit it"));
    }
    if (checks.block_bytes > 0 && slot.written < checks.block_bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat(where, " has ", slot.written, " of its ", checks.block_bytes,
                       " bytes written: a block is committed only once every byte is written"));
    }
    fresh.push_back(e.block);
  }
  for (const CommitEntry& e : entries) {
    Slot& slot = slots_[e.block];
    if (slot.state == State::kCommitted) continue;
    slot.state = State::kCommitted;
    slot.page = e.page;
    slot.parent = e.parent;
    slot.committed_unix_ms = committed_unix_ms;
    ++committed_;
  }
  return fresh;
}

void BlockLedger::AddWritten(BlockId id, uint64_t bytes) {
  Slot& slot = slots_[id];
  if (slot.state != State::kAllocated) return;
  slot.written = bytes > UINT64_MAX - slot.written ? UINT64_MAX : slot.written + bytes;
}

absl::Status BlockLedger::CommitCopy(BlockId target, const CommittedBlock& source) {
  Slot& slot = slots_[target];
  if (slot.state != State::kAllocated || slot.owner_epoch != source.owner_epoch) {
    return absl::FailedPreconditionError(absl::StrCat("target_block_ids: block ", target,
                                                      " is not allocated to owner epoch ",
                                                      source.owner_epoch));
  }
  slot.state = State::kCommitted;
  slot.ns = Intern(*source.ns);
  slot.page = source.page;
  slot.parent = source.parent;
  slot.committed_unix_ms = source.committed_unix_ms;
  ++committed_;
  return absl::OkStatus();
}

absl::Status BlockLedger::CheckCommitted(std::span<const BlockId> ids, uint64_t epoch,
                                         absl::string_view field) const {
  if (absl::Status s = Check(ids, epoch, /*writable=*/false, field); !s.ok()) return s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (slots_[ids[i]].state != State::kCommitted) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, "[", i, "]: block ", ids[i], " is not committed"));
    }
  }
  return absl::OkStatus();
}

absl::Status BlockLedger::Release(std::span<const BlockId> ids, uint64_t epoch,
                                  absl::string_view field) {
  if (absl::Status s = CheckCommitted(ids, epoch, field); !s.ok()) return s;
  for (BlockId id : ids) {
    Slot& slot = slots_[id];
    slot.state = State::kAllocated;
    slot.page = slot.parent = PageHash{};
    slot.committed_unix_ms = 0;
    slot.digest = 0;
    --committed_;
  }
  return absl::OkStatus();
}

absl::Status BlockLedger::FreeCommitted(std::span<const BlockId> ids, uint64_t epoch,
                                        absl::string_view field) {
  if (absl::Status s = CheckCommitted(ids, epoch, field); !s.ok()) return s;
  for (BlockId id : ids) MakeFree(id);
  return absl::OkStatus();
}

absl::Status BlockLedger::CheckGenerations(std::span<const BlockId> ids,
                                           std::span<const uint64_t> generations,
                                           absl::string_view field) const {
  if (generations.empty()) return absl::OkStatus();
  if (generations.size() != ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("block_generations: ", generations.size(),
                                                   " generations for ", ids.size(),
                                                   " block ids (one per id)"));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= slots_.size()) {
      return absl::OutOfRangeError(absl::StrCat(field, "[", i, "]: block ", ids[i],
                                                " is past the pool of ", slots_.size(), " blocks"));
    }
    const Slot& slot = slots_[ids[i]];
    if (generations[i] == 0 || slot.generation == generations[i]) continue;
    if (generations[i] >= next_generation_) {
      return absl::InvalidArgumentError(absl::StrCat("block_generations[", i, "]: ", generations[i],
                                                     " is not a generation Allocate gave"));
    }
    return absl::AbortedError(absl::StrCat(field, "[", i, "]: block ", ids[i], " was freed",
                                           slot.state == State::kFree ? "" : " and reallocated",
                                           " since generation ", generations[i],
                                           "; its allocation ended"));
  }
  return absl::OkStatus();
}

absl::Status BlockLedger::Check(std::span<const BlockId> ids, uint64_t owner_epoch, bool writable,
                                absl::string_view field,
                                std::span<const uint64_t> generations) const {
  if (absl::Status s = CheckList(ids, owner_epoch, field, absl::StatusCode::kInvalidArgument);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckGenerations(ids, generations, field); !s.ok()) return s;
  for (BlockId id : ids) {
    const Slot& slot = slots_[id];
    if (slot.state == State::kFree) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, ": block ", id, " is not allocated"));
    }
    if (slot.owner_epoch != owner_epoch) {
      return absl::FailedPreconditionError(absl::StrCat(field, ": block ", id,
                                                        " belongs to owner epoch ",
                                                        slot.owner_epoch, ", not ", owner_epoch));
    }
    if (writable && slot.state == State::kCommitted) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, ": block ", id, " is committed to the cache and cannot change"));
    }
  }
  return absl::OkStatus();
}

uint64_t BlockLedger::FreeAllOwnedBy(uint64_t owner_epoch) {
  if (owner_epoch == 0) return 0;
  uint64_t freed = 0;
  for (BlockId id = 0; id < slots_.size(); ++id) {
    if (slots_[id].state == State::kFree || slots_[id].owner_epoch != owner_epoch) continue;
    MakeFree(id);
    ++freed;
  }
  return freed;
}

uint64_t BlockLedger::AllocatedToTenant(uint64_t owner_epoch, absl::string_view tenant) const {
  if (allocated_blocks() == 0) return 0;  // no scan of a pool with no store in flight
  uint64_t n = 0;
  for (const Slot& slot : slots_) {
    if (slot.state == State::kAllocated && slot.owner_epoch == owner_epoch &&
        slot.ns != kNoNamespace && namespaces_[slot.ns].tenant == tenant) {
      ++n;
    }
  }
  return n;
}

uint64_t BlockLedger::FreeAllocatedBefore(uint64_t owner_epoch, int64_t cutoff_unix_ms) {
  // Every heartbeat, under the pool's lock: no scan while no store is in flight.
  if (owner_epoch == 0 || allocated_blocks() == 0) return 0;
  uint64_t freed = 0;
  for (BlockId id = 0; id < slots_.size(); ++id) {
    const Slot& slot = slots_[id];
    if (slot.state != State::kAllocated || slot.owner_epoch != owner_epoch ||
        slot.ns == kNoNamespace || slot.allocated_unix_ms == 0 ||
        slot.allocated_unix_ms >= cutoff_unix_ms) {
      continue;
    }
    MakeFree(id);
    ++freed;
  }
  return freed;
}

void BlockLedger::ForEachCommitted(absl::FunctionRef<void(const CommittedBlock&)> fn) const {
  if (committed_ == 0) return;
  for (BlockId id = 0; id < slots_.size(); ++id) {
    if (slots_[id].state == State::kCommitted) fn(Committed(id));
  }
}

absl::Status BlockLedger::CheckPages(std::span<const BlockId> ids, const NamespaceId& ns,
                                     std::span<const PageHash> pages,
                                     absl::string_view field) const {
  if (pages.size() != ids.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", pages.size(), " page hashes for ", ids.size(), " block ids"));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= slots_.size()) {
      return absl::OutOfRangeError(
          absl::StrCat(field, "[", i, "]: block ", ids[i], " is past the pool of ", slots_.size()));
    }
    const Slot& slot = slots_[ids[i]];
    if (slot.state != State::kCommitted || namespaces_[slot.ns] != ns || slot.page != pages[i]) {
      // Never says what the block holds now: that may be another tenant's page.
      return absl::AbortedError(absl::StrCat(field, "[", i, "]: block ", ids[i],
                                             " no longer holds page ", pages[i].ToHex()));
    }
  }
  return absl::OkStatus();
}

CommittedBlock BlockLedger::Committed(BlockId id) const {
  const Slot& slot = slots_[id];
  if (slot.state != State::kCommitted) return CommittedBlock{.block = id};
  return CommittedBlock{.ns = &namespaces_[slot.ns],
                        .block = id,
                        .page = slot.page,
                        .parent = slot.parent,
                        .owner_epoch = slot.owner_epoch,
                        .committed_unix_ms = slot.committed_unix_ms};
}

const NamespaceId* BlockLedger::NamespaceOf(BlockId id) const {
  const Slot& slot = slots_[id];
  if (slot.state == State::kFree || slot.ns == kNoNamespace) return nullptr;
  return &namespaces_[slot.ns];
}

uint32_t BlockLedger::Intern(const NamespaceId& ns) {
  auto [it, inserted] = namespace_index_.try_emplace(ns, namespaces_.size());
  if (inserted) namespaces_.push_back(ns);
  return it->second;
}

void BlockLedger::MakeFree(BlockId id) {
  if (slots_[id].state == State::kCommitted) --committed_;
  const uint32_t last_ns = slots_[id].ns;
  slots_[id] = Slot{.last_ns = last_ns};  // generation 0: the allocation ended
  free_.push_back(id);
}

}  // namespace kvcm
