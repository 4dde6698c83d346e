#include "gpu/agent/local/local_session.h"

#include <unistd.h>

#include <algorithm>
#include <optional>
#include <span>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "gpu/agent/server/block_agent_access.h"
#include "gpu/agent/server/block_stream_reactors.h"

#ifdef KVCM_CUDA_ENABLED
#include "gpu/agent/local/cuda_ipc_region.h"
#endif

namespace kvcm {
namespace {

v1::LocalReply ReplyOf(const absl::Status& status, v1::LocalReply reply = {}) {
  reply.set_code(static_cast<uint32_t>(status.code()));
  if (!status.ok()) reply.set_message(std::string(status.message()));
  return reply;
}

absl::string_view DirectionName(v1::LocalDirection d) {
  switch (d) {
    case v1::LOCAL_DIRECTION_LOAD:
      return "load";
    case v1::LOCAL_DIRECTION_STORE:
      return "store";
    default:
      return "invalid";
  }
}

// Checks `ipc` against the layout (one 64-byte handle per segment) and opens it; without
// CUDA in the build, FAILED_PRECONDITION saying so.
absl::StatusOr<std::unique_ptr<EngineRegion>> OpenCudaIpc(const v1::CudaIpcRegion& ipc,
                                                          std::span<const uint64_t> ends) {
  if (ipc.pci_bus_id().empty()) {
    return absl::InvalidArgumentError(
        "cuda_ipc.pci_bus_id: required (the engine's device, as cudaDeviceGetPCIBusId writes it)");
  }
  if (static_cast<size_t>(ipc.segment_handles_size()) != ends.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc.segment_handles: ", ipc.segment_handles_size(), " handles for ",
                     ends.size(), " segment_offsets (one handle per segment)"));
  }
  constexpr size_t kHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
  for (int s = 0; s < ipc.segment_handles_size(); ++s) {
    if (ipc.segment_handles(s).size() != kHandleBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_ipc.segment_handles[", s, "]: must be a cudaIpcMemHandle_t of ",
                       kHandleBytes, " bytes, got ", ipc.segment_handles(s).size(),
                       ipc.segment_handles(s).size() == kHandleBytes + 2
                           ? " (torch's _share_cuda_ handle: strip its 2 leading bytes)"
                           : ""));
    }
  }
#ifdef KVCM_CUDA_ENABLED
  static_assert(kHandleBytes == kCudaIpcHandleBytes);
  return OpenCudaIpcRegion(ipc, ends);
#else
  return absl::FailedPreconditionError(
      "cuda_ipc: this agent was built without CUDA (KVCM_ENABLE_CUDA=OFF); register a memfd");
#endif
}

}  // namespace

LocalSession::LocalSession(LocalSessionEnv env, std::string peer, uint32_t peer_uid)
    : env_(env), peer_(std::move(peer)), peer_uid_(peer_uid) {}

LocalSession::~LocalSession() = default;

v1::LocalReply LocalSession::Handle(absl::string_view datagram, std::vector<int> fds,
                                    bool truncated) {
  // Every fd is closed on the way out: a hello's mapping outlives its descriptor.
  struct CloseAll {
    std::vector<int>& fds;
    ~CloseAll() {
      for (int fd : fds) close(fd);
    }
  } close_all{fds};
  if (truncated) {
    return ReplyOf(absl::InvalidArgumentError(
        absl::StrCat("request: longer than ", kMaxRequestBytes, " bytes")));
  }
  v1::LocalRequest req;
  if (!req.ParseFromArray(datagram.data(), static_cast<int>(datagram.size()))) {
    return ReplyOf(absl::InvalidArgumentError("request: not a LocalRequest message"));
  }
  v1::LocalReply reply;
  switch (req.request_case()) {
    case v1::LocalRequest::kHello: {
      const absl::Status s = Hello(req.hello(), fds, &reply);
      return ReplyOf(s, std::move(reply));
    }
    case v1::LocalRequest::kCopy: {
      absl::Status s;
      if (!fds.empty()) {
        s = absl::InvalidArgumentError("copy: carries file descriptors; only a hello may");
      } else {
        s = Copy(req.copy(), &reply);
      }
      if (env_.metrics != nullptr) {
        env_.metrics->RecordLocalCopy(DirectionName(req.copy().direction()), s,
                                      reply.bytes_copied());
      }
      if (!s.ok()) {  // only how far a copy stopped midway got
        const uint32_t blocks = reply.blocks_copied();
        const uint64_t bytes = reply.bytes_copied();
        reply.Clear();
        reply.set_blocks_copied(blocks);
        reply.set_bytes_copied(bytes);
      }
      return ReplyOf(s, std::move(reply));
    }
    default:
      return ReplyOf(absl::InvalidArgumentError("request: neither a hello nor a copy"));
  }
}

absl::Status LocalSession::Hello(const v1::LocalHello& h, std::span<const int> fds,
                                 v1::LocalReply* reply) {
  if (region_ != nullptr) {
    return absl::FailedPreconditionError("hello: this connection already registered a region");
  }
  // Exactly one kind of memory: a memfd or CUDA IPC handles.
  const bool cuda = h.has_cuda_ipc();
  if (cuda && !fds.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hello: carries both cuda_ipc and ", fds.size(),
                     " file descriptors; send a memfd or cuda_ipc, not both"));
  }
  if (!cuda && fds.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("hello: must carry exactly one file descriptor (SCM_RIGHTS) or cuda_ipc, got ",
                     fds.size(), " file descriptors"));
  }
  // Who first: an unauthenticated peer learns nothing of the pool.
  std::shared_ptr<const Principal> principal;
  KVCM_ASSIGN_OR_RETURN(principal, Authenticate(h.token()));
  const uint64_t bytes_per_block = env_.pools.main->geometry().bytes_per_block();
  const uint64_t region = h.region_bytes();
  if (region < 1 || region > kMaxRegionBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("region_bytes must be in [1, ", kMaxRegionBytes, "], got ", region));
  }
  const int segments = h.segment_offsets_size();
  if (segments < 1 || segments > kMaxSegments) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment_offsets must list 1..", kMaxSegments, " segments, got ", segments));
  }
  if (h.segment_bytes() < 1 || h.segment_bytes() > bytes_per_block ||
      h.segment_bytes() * static_cast<uint64_t>(segments) != bytes_per_block) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment_bytes: ", segments, " segments of ", h.segment_bytes(),
                     " bytes do not make the pool's blocks of ", bytes_per_block, " bytes"));
  }
  if (h.num_engine_blocks() < 1 || h.num_engine_blocks() > kMaxEngineBlocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_engine_blocks must be in [1, ", kMaxEngineBlocks, "], got ", h.num_engine_blocks()));
  }
  // Offsets grow with the block (stride >= 0): the last engine block's segment ends last.
  std::vector<uint64_t> ends(segments);
  for (int s = 0; s < segments; ++s) {
    const unsigned __int128 end =
        static_cast<unsigned __int128>(h.segment_offsets(s)) +
        static_cast<unsigned __int128>(h.num_engine_blocks() - 1) * h.segment_stride() +
        h.segment_bytes();
    if (end > region) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segment_offsets[", s, "]: segment ", s, " of engine block ", h.num_engine_blocks() - 1,
          " (offset ", h.segment_offsets(s), " + ", h.num_engine_blocks() - 1, " x segment_stride ",
          h.segment_stride(), ") ends past region_bytes ", region));
    }
    ends[s] = static_cast<uint64_t>(end);
  }
  std::unique_ptr<EngineRegion> mapped;
  if (cuda) {
    KVCM_ASSIGN_OR_RETURN(mapped, OpenCudaIpc(h.cuda_ipc(), ends));
  } else {
    KVCM_ASSIGN_OR_RETURN(mapped, MapMemfdRegion(fds[0], region));
  }
  region_ = std::move(mapped);
  principal_ = std::move(principal);
  token_ = h.token();
  segment_offsets_.assign(h.segment_offsets().begin(), h.segment_offsets().end());
  segment_bytes_ = h.segment_bytes();
  segment_stride_ = h.segment_stride();
  num_engine_blocks_ = h.num_engine_blocks();
  if (env_.metrics != nullptr) env_.metrics->RecordLocalSession("opened");
  LogInfo(absl::StrCat("local session of ", peer_, " (principal ", principal_->name,
                       ") registered ", region_->Describe(), ": ", num_engine_blocks_,
                       " engine blocks of ", segments, " segments x ", segment_bytes_, " bytes"));
  reply->set_epoch(env_.epoch != nullptr ? env_.epoch->current() : 0);
  reply->set_bytes_per_block(bytes_per_block);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Principal>> LocalSession::Authenticate(
    const std::string& token) const {
  std::shared_ptr<const Principal> principal;
  if (token.empty()) {
    KVCM_ASSIGN_OR_RETURN(principal, env_.authenticator->AuthenticateValue(nullptr));
  } else {
    const std::string value = absl::StrCat("Bearer ", token);
    const absl::string_view view(value);
    KVCM_ASSIGN_OR_RETURN(principal, env_.authenticator->AuthenticateValue(&view));
  }
  if (env_.principal_uids != nullptr) {
    const auto it = env_.principal_uids->find(principal->name);
    if (it != env_.principal_uids->end() &&
        std::find(it->second.begin(), it->second.end(), peer_uid_) == it->second.end()) {
      return absl::PermissionDeniedError(absl::StrCat("principal ", principal->name,
                                                      " may not be used from uid ", peer_uid_,
                                                      " (local_principal_uids)"));
    }
  }
  return principal;
}

absl::Status LocalSession::Copy(const v1::LocalCopy& c, v1::LocalReply* reply) {
  if (region_ == nullptr) {
    return absl::FailedPreconditionError("copy: no region yet (send a hello first)");
  }
  // The token is checked again on every copy: a token revoked (or rebound) since the hello
  // ends the session here, before anything is read.
  absl::StatusOr<std::shared_ptr<const Principal>> now = Authenticate(token_);
  if (!now.ok()) {
    ended_ = true;
    LogWarning(absl::StrCat("local session of ", peer_, " (principal ", principal_->name,
                            ") closed: ", now.status().message()));
    if (env_.metrics != nullptr) env_.metrics->RecordLocalSession("revoked");
    return absl::Status(now.status().code(),
                        absl::StrCat(now.status().message(), "; the session is closed"));
  }
  principal_ = *std::move(now);
  const bool load = c.direction() == v1::LOCAL_DIRECTION_LOAD;
  if (!load && c.direction() != v1::LOCAL_DIRECTION_STORE) {
    return absl::InvalidArgumentError(absl::StrCat(
        "direction must be LOCAL_DIRECTION_LOAD or LOCAL_DIRECTION_STORE, got ", c.direction()));
  }
  const AgentOptions& options = *env_.options;
  // As ReadBlocks (either pool) and WriteBlocks (the main pool only).
  BlockPool* pool = c.tier() == v1::TIER_UNSPECIFIED
                        ? env_.pools.main
                        : env_.pools.ForWireTier(options.tier, static_cast<int>(c.tier()));
  if (pool == nullptr || (!load && pool != env_.pools.main)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier ", static_cast<int>(c.tier()), " is not a pool of this agent",
                     load ? "" : " that blocks are written to (STORE writes the main pool)"));
  }
  const int n = c.block_ids_size();
  if (n < 1 || n > static_cast<int>(options.max_blocks_per_call)) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_ids must list 1..", options.max_blocks_per_call, " blocks, got ", n));
  }
  if (c.engine_blocks_size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("engine_blocks: ", c.engine_blocks_size(),
                                                   " engine blocks for ", n, " block ids"));
  }
  absl::flat_hash_set<uint32_t> seen;
  for (int i = 0; i < n; ++i) {
    const uint32_t e = c.engine_blocks(i);
    if (e >= num_engine_blocks_) {
      return absl::InvalidArgumentError(absl::StrCat("engine_blocks[", i, "]: ", e,
                                                     " is past the region's ", num_engine_blocks_,
                                                     " engine blocks"));
    }
    if (load && !seen.insert(e).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("engine_blocks[", i, "]: engine block ", e, " is listed twice"));
    }
  }
  const std::span<const BlockId> ids(c.block_ids().data(), n);
  const std::span<const uint64_t> gens(c.block_generations().data(), c.block_generations_size());
  // STORE as WriteBlocks: a worker must name the allocations it writes; LOAD as ReadBlocks:
  // optional, checked when given.
  if (!load || !gens.empty()) {
    KVCM_RETURN_IF_ERROR(RequireGenerations(*principal_, n, gens, "block_generations"));
  }
  std::optional<OwnedPageCheck> pages;
  if (!load && (c.has_namespace_() || !c.page_hashes().empty())) {
    return absl::InvalidArgumentError("page_hashes: only a LOAD checks pages");
  }
  KVCM_ASSIGN_OR_RETURN(pages,
                        DecodePageCheck(c.has_namespace_(), c.namespace_(), c.page_hashes(), n));
  std::vector<uint64_t> bound;
  KVCM_RETURN_IF_ERROR(
      AuthorizeBlocks(*principal_, pool, ids, load ? "read blocks" : "write blocks", gens, &bound));
  const std::optional<PageCheck> check =
      pages.has_value() ? std::optional<PageCheck>(pages->view()) : std::nullopt;
  const uint64_t bytes_per_block = pool->geometry().bytes_per_block();
  // Every check of every block first, all at once: a refusal known now moves no byte.
  KVCM_RETURN_IF_ERROR(pool->WithCheckedBlocks(ids, c.owner_epoch(), /*writable=*/!load,
                                               "block_ids", bound, check ? &*check : nullptr,
                                               [](DeviceBackend&) { return absl::OkStatus(); }));
  // Then the copies, chunk by chunk: segments in order (block i's, then block i + 1's), at
  // most local_copy_chunk_bytes of them (at least one) per critical section of the pool's
  // lock, each checking again, under that lock, the blocks whose segments it copies.
  const size_t segments = segment_offsets_.size();
  const uint64_t per_chunk = std::max<uint64_t>(1, options.local_copy_chunk_bytes / segment_bytes_);
  const uint64_t total = static_cast<uint64_t>(n) * segments;
  for (uint64_t first = 0; first < total;) {
    const uint64_t end = std::min(total, first + per_chunk);
    const size_t lo = first / segments;
    const size_t hi = (end - 1) / segments + 1;  // blocks [lo, hi) have segments in the chunk
    const std::span<const uint64_t> chunk_bound =
        bound.empty() ? std::span<const uint64_t>()
                      : std::span<const uint64_t>(bound).subspan(lo, hi - lo);
    std::optional<PageCheck> chunk_check;
    if (check) chunk_check = PageCheck{.ns = check->ns, .pages = check->pages.subspan(lo, hi - lo)};
    // A STORE records the bytes each block of the chunk receives (its segments in it).
    std::vector<uint64_t> written;
    if (!load) {
      written.assign(hi - lo, 0);
      for (uint64_t k = first; k < end; ++k) written[k / segments - lo] += segment_bytes_;
    }
    const absl::Status s = pool->WithCheckedBlocks(
        ids.subspan(lo, hi - lo), c.owner_epoch(), /*writable=*/!load, "block_ids", chunk_bound,
        chunk_check ? &*chunk_check : nullptr,
        [&](DeviceBackend& backend) -> absl::Status {
          // Only a failing copy (a device error) stops midway, and Finish waits for what
          // was issued before the pool's lock is released.
          absl::Status copied;
          for (uint64_t k = first; k < end && copied.ok(); ++k) {
            const size_t i = k / segments;
            const size_t seg = k % segments;
            const uint64_t mine = segment_offsets_[seg] + c.engine_blocks(i) * segment_stride_;
            const uint64_t theirs = pool->BlockOffset(ids[i]) + seg * segment_bytes_;
            copied = load ? region_->Load(backend, theirs, seg, mine, segment_bytes_)
                          : region_->Store(backend, theirs, seg, mine, segment_bytes_);
          }
          const absl::Status finished = region_->Finish();
          return copied.ok() ? finished : copied;
        },
        written);
    if (!s.ok()) {
      // Blocks [0, lo) are whole; a block freed, reallocated or recommitted since the first
      // check (or a device error) stops the rest.
      reply->set_blocks_copied(static_cast<uint32_t>(lo));
      reply->set_bytes_copied(static_cast<uint64_t>(lo) * bytes_per_block);
      return absl::Status(
          s.code(), absl::StrCat(s.message(), " (after ", lo, " of ", n, " blocks were copied)"));
    }
    first = end;
  }
  reply->set_blocks_copied(static_cast<uint32_t>(n));
  reply->set_bytes_copied(static_cast<uint64_t>(n) * bytes_per_block);
  return absl::OkStatus();
}

}  // namespace kvcm
