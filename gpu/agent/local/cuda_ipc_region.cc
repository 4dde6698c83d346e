// CudaIpcRegion: a host-compiled file linked with the CUDA runtime (no kernels here). The
// driver's cuMemGetAddressRange comes through the runtime's entry-point lookup, so the agent
// does not link libcuda and still starts on a host without a driver.
#include "gpu/agent/local/cuda_ipc_region.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gpu/agent/pool/device_backend.h"

namespace kvcm {
namespace {

// `what`: the CUDA error's name and text, as a Status of `code`. IPC and copy errors are
// not sticky: clear the thread's last error so later calls do not report it again.
absl::Status CudaError(absl::StatusCode code, absl::string_view what, cudaError_t err) {
  cudaGetLastError();
  return absl::Status(
      code, absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

class CudaIpcRegion final : public EngineRegion {
 public:
  CudaIpcRegion(int device, std::string pci_bus_id)
      : device_(device), pci_bus_id_(std::move(pci_bus_id)) {}
  ~CudaIpcRegion() override {
    cudaSetDevice(device_);
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    for (void* p : opened_) cudaIpcCloseMemHandle(p);
  }
  CudaIpcRegion(const CudaIpcRegion&) = delete;
  CudaIpcRegion& operator=(const CudaIpcRegion&) = delete;

  std::string Describe() const override {
    return absl::StrCat("CUDA IPC on ", pci_bus_id_, " (device ", device_, "): ", opened_.size(),
                        " allocations");
  }

  absl::Status Load(DeviceBackend& pool, uint64_t pool_offset, size_t segment, uint64_t offset,
                    uint64_t bytes) override {
    if (absl::Status s = CheckPool(pool, pool_offset, bytes); !s.ok()) return s;
    return Enqueue(segment_base_[segment] + offset, pool.base() + pool_offset, bytes);
  }
  absl::Status Store(DeviceBackend& pool, uint64_t pool_offset, size_t segment, uint64_t offset,
                     uint64_t bytes) override {
    if (absl::Status s = CheckPool(pool, pool_offset, bytes); !s.ok()) return s;
    return Enqueue(pool.base() + pool_offset, segment_base_[segment] + offset, bytes);
  }
  absl::Status Finish() override {
    if (const cudaError_t err = cudaStreamSynchronize(stream_); err != cudaSuccess) {
      return CudaError(absl::StatusCode::kInternal, "copy: cudaStreamSynchronize", err);
    }
    return absl::OkStatus();
  }

  // Opens `ipc`'s allocations; see OpenCudaIpcRegion.
  absl::Status Open(const v1::CudaIpcRegion& ipc, std::span<const uint64_t> segment_ends) {
    if (const cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
      return CudaError(absl::StatusCode::kInternal, "cuda_ipc: cudaSetDevice", err);
    }
    if (const cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        err != cudaSuccess) {
      stream_ = nullptr;
      return CudaError(absl::StatusCode::kInternal, "cuda_ipc: cudaStreamCreateWithFlags", err);
    }
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (const cudaError_t err = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 3020,
                                                                 cudaEnableDefault, &found);
        err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
      return CudaError(absl::StatusCode::kInternal,
                       "cuda_ipc: the driver's cuMemGetAddressRange (cudaGetDriverEntryPoint)",
                       err != cudaSuccess ? err : cudaErrorSymbolNotFound);
    }
    const auto address_range = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(fn);
    // Each distinct handle once: its opened start and the bytes of its allocation from there.
    struct Allocation {
      std::byte* start;
      uint64_t bytes;
    };
    absl::flat_hash_map<std::string, Allocation> by_handle;
    for (size_t s = 0; s < segment_ends.size(); ++s) {
      const std::string& handle = ipc.segment_handles(static_cast<int>(s));
      auto it = by_handle.find(handle);
      if (it == by_handle.end()) {
        cudaIpcMemHandle_t h;
        static_assert(sizeof(h) == kCudaIpcHandleBytes);
        std::memcpy(&h, handle.data(), sizeof(h));
        void* p = nullptr;
        if (const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
            err != cudaSuccess) {
          return CudaError(absl::StatusCode::kFailedPrecondition,
                           absl::StrCat("cuda_ipc.segment_handles[", s, "]: cudaIpcOpenMemHandle"),
                           err);
        }
        opened_.push_back(p);
        CUdeviceptr base = 0;
        size_t size = 0;
        const CUdeviceptr start = reinterpret_cast<CUdeviceptr>(p);
        if (const CUresult r = address_range(&base, &size, start); r != CUDA_SUCCESS) {
          return absl::InternalError(absl::StrCat("cuda_ipc.segment_handles[", s,
                                                  "]: cuMemGetAddressRange: CUresult ",
                                                  static_cast<int>(r)));
        }
        it = by_handle.emplace(handle, Allocation{static_cast<std::byte*>(p), base + size - start})
                 .first;
      }
      if (segment_ends[s] > it->second.bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("segment_offsets[", s, "]: segment ", s, " of the last engine block ends ",
                         segment_ends[s],
                         " bytes past its allocation's base, but the allocation of "
                         "cuda_ipc.segment_handles[",
                         s, "] has ", it->second.bytes, " bytes"));
      }
      segment_base_.push_back(it->second.start);
    }
    return absl::OkStatus();
  }

 private:
  // OUT_OF_RANGE unless [offset, offset + bytes) lies within the pool's arena.
  static absl::Status CheckPool(const DeviceBackend& pool, uint64_t offset, uint64_t bytes) {
    if (offset > pool.arena_bytes() || bytes > pool.arena_bytes() - offset) {
      return absl::OutOfRangeError(absl::StrCat("copy: pool range [", offset, ", +", bytes,
                                                ") leaves the arena of ", pool.arena_bytes(),
                                                " bytes"));
    }
    return absl::OkStatus();
  }

  absl::Status Enqueue(void* dst, const void* src, uint64_t bytes) {
    // The calling thread's device may be the pool's (CudaBackend sets it on its copies).
    if (const cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
      return CudaError(absl::StatusCode::kInternal, "copy: cudaSetDevice", err);
    }
    if (const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_);
        err != cudaSuccess) {
      return CudaError(absl::StatusCode::kInternal, "copy: cudaMemcpyAsync", err);
    }
    return absl::OkStatus();
  }

  const int device_;
  const std::string pci_bus_id_;
  cudaStream_t stream_ = nullptr;
  // Every cudaIpcOpenMemHandle that succeeded, closed once each when the region goes.
  std::vector<void*> opened_;
  // Per segment: where its allocation starts in this process.
  std::vector<std::byte*> segment_base_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<EngineRegion>> OpenCudaIpcRegion(
    const v1::CudaIpcRegion& ipc, std::span<const uint64_t> segment_ends) {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok() || *count < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda_ipc: no CUDA device on the agent's host (",
                     count.ok() ? "cudaGetDeviceCount: 0 devices" : count.status().message(),
                     "); register a memfd"));
  }
  int device = -1;
  if (const cudaError_t err = cudaDeviceGetByPCIBusId(&device, ipc.pci_bus_id().c_str());
      err != cudaSuccess) {
    return CudaError(absl::StatusCode::kFailedPrecondition,
                     absl::StrCat("cuda_ipc.pci_bus_id: no CUDA device at \"", ipc.pci_bus_id(),
                                  "\" on the agent's host (cudaDeviceGetByPCIBusId)"),
                     err);
  }
  auto region = std::make_unique<CudaIpcRegion>(device, ipc.pci_bus_id());
  // On an error the region's destructor closes what it opened.
  if (absl::Status s = region->Open(ipc, segment_ends); !s.ok()) return s;
  return region;
}

}  // namespace kvcm
