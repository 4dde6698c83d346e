// DeviceBackend: the memory a block pool lives in, behind one interface with a factory.
//
// A backend owns one arena, allocated once when it is created (one cudaMalloc for CUDA, one
// heap allocation for the host), and never allocates afterwards: the block pool carves the
// arena into blocks, so nothing on the allocate/free hot path touches the device allocator.
//   HostBackend  DRAM; always built, used by every test and when no GPU is present.
//   CudaBackend  device memory of one GPU; compiled only when KVCM_CUDA_ENABLED.
// Implementations are thread-safe: the arena is fixed and copies touch caller-chosen ranges.
#ifndef KVCM_GPU_AGENT_POOL_DEVICE_BACKEND_H_
#define KVCM_GPU_AGENT_POOL_DEVICE_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcm {

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  // "host" or "cuda:<index>".
  virtual std::string name() const = 0;
  // True when base() is device memory (not dereferenceable on the host).
  virtual bool is_device() const = 0;
  // Start of the arena; arena_bytes() long.
  virtual std::byte* base() const = 0;
  virtual uint64_t arena_bytes() const = 0;

  // Copies host bytes into the arena at `offset`, and arena bytes out to the host.
  // OUT_OF_RANGE when the range leaves the arena; a device error as a Status.
  virtual absl::Status CopyIn(uint64_t offset, std::span<const std::byte> src) = 0;
  virtual absl::Status CopyOut(uint64_t offset, std::span<std::byte> dst) const = 0;

 protected:
  // OUT_OF_RANGE unless [offset, offset + bytes) lies within the arena.
  absl::Status CheckRange(uint64_t offset, uint64_t bytes) const;
};

// A DRAM arena of `arena_bytes` (>= 1). RESOURCE_EXHAUSTED when it cannot be allocated.
absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateHostBackend(uint64_t arena_bytes);

// A host backend over `arena` (arena_bytes long, allocated elsewhere, e.g. page-locked by
// cudaHostAlloc), reported as `name`; `release` frees it when the backend goes.
// REQUIRES: arena != nullptr, arena_bytes >= 1.
std::unique_ptr<DeviceBackend> AdoptHostArena(std::byte* arena, uint64_t arena_bytes,
                                              std::string name, void (*release)(std::byte*));

struct BackendOptions {
  // Bytes of the arena. >= 1.
  uint64_t arena_bytes = 0;
  // CUDA device to use when one is present.
  int device_index = 0;
  // False forces the host backend even when a GPU is present.
  bool allow_device = true;
};

// What CreateBackend chose, and why (for the log).
struct BackendChoice {
  std::unique_ptr<DeviceBackend> backend;
  std::string reason;  // e.g. "no CUDA device (cudaGetDeviceCount: ...): using host DRAM"
};

// A CUDA backend on options.device_index when this build has CUDA and a device is present;
// otherwise the host backend. Any cudaGetDeviceCount error counts as "no device" (without a
// GPU it reports error 35, insufficient driver). INVALID_ARGUMENT "device_index" when the
// index is not a present device; RESOURCE_EXHAUSTED when the arena cannot be allocated.
absl::StatusOr<BackendChoice> CreateBackend(const BackendOptions& options);

#ifdef KVCM_CUDA_ENABLED
// Number of CUDA devices, or the error cudaGetDeviceCount reports (as UNAVAILABLE).
absl::StatusOr<int> CudaDeviceCount();
// One cudaMalloc of `arena_bytes` on device `device_index`.
absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaBackend(int device_index,
                                                                 uint64_t arena_bytes);
// A host arena of page-locked memory (one cudaHostAlloc, named "host-pinned"), so that
// copies between it and a device run at full link speed without staging: the host pool of
// an agent whose main pool is on a GPU. The CUDA error (e.g. no driver) as a Status.
absl::StatusOr<std::unique_ptr<DeviceBackend>> CreatePinnedHostBackend(uint64_t arena_bytes);
#endif

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_POOL_DEVICE_BACKEND_H_
