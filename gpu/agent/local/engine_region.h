// EngineRegion: the engine's KV memory as a LocalSession copies to and from it, behind one
// interface so the session's checks are written once (proto/kvcm/v1/local.proto LocalHello):
//   MapMemfdRegion     host memory: an allocated, sealed memfd the session maps MAP_SHARED;
//                      memcpy.
//   OpenCudaIpcRegion  device memory of a GPU engine (cuda_ipc_region.h, CUDA builds only):
//                      one opened CUDA IPC allocation per segment; cudaMemcpyAsync.
// Segment s of the engine's memory is a byte range from its own base (the region's start,
// or the base of segment s's allocation); the session has checked the layout against the
// memory's size, so the copies trust their ranges (as kernels trust their launchers).
//
// Not thread-safe: owned and used by one LocalSession.
#ifndef KVCM_GPU_AGENT_LOCAL_ENGINE_REGION_H_
#define KVCM_GPU_AGENT_LOCAL_ENGINE_REGION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/agent/pool/device_backend.h"

namespace kvcm {

class EngineRegion {
 public:
  virtual ~EngineRegion() = default;

  // For the log, e.g. "memfd of 4096 bytes".
  virtual std::string Describe() const = 0;

  // LOAD: copies `bytes` of the pool's arena at `pool_offset` to segment `segment` of the
  // engine's memory at `offset`. STORE: the other way. REQUIRES: both ranges lie within
  // their memory (the hello's layout checks, BlockPool::BlockOffset). A copy may still be in
  // flight when these return; Finish waits for it.
  virtual absl::Status Load(DeviceBackend& pool, uint64_t pool_offset, size_t segment,
                            uint64_t offset, uint64_t bytes) = 0;
  virtual absl::Status Store(DeviceBackend& pool, uint64_t pool_offset, size_t segment,
                             uint64_t offset, uint64_t bytes) = 0;

  // Waits for every copy issued since the last Finish: the first error of those copies.
  // Called once after the last copy of a request, also when a Load or Store failed, before
  // the pool's lock is released.
  virtual absl::Status Finish() { return absl::OkStatus(); }
};

// Maps the first `region_bytes` of `fd` read/write (MAP_SHARED): INVALID_ARGUMENT naming
// "fd" for a descriptor that is not a regular file, not sealed against shrinking (a file
// that shrinks would fault the agent with SIGBUS on a copy) or with a hole in
// [0, region_bytes) (the agent's copies would allocate it, charged to the agent), "region_bytes"
// when the file is smaller; INTERNAL when mmap fails. On success the file is sealed with
// F_SEAL_FUTURE_WRITE, so no hole can appear later (punching one is EPERM; mappings made
// before keep working). The caller keeps `fd` (the mapping does not need it).
absl::StatusOr<std::unique_ptr<EngineRegion>> MapMemfdRegion(int fd, uint64_t region_bytes);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_LOCAL_ENGINE_REGION_H_
