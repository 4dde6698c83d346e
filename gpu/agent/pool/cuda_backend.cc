// CudaBackend: one cudaMalloc arena on one device. Built only when KVCM_CUDA_ENABLED; a
// host-compiled file linked with the CUDA runtime (no kernels here).
#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/agent/pool/device_backend.h"
#include "gpu/kernels/cuda_status.h"

namespace kvcm {
namespace {

// Device memory of one GPU. Thread-safe: copies set the device and touch disjoint,
// caller-chosen ranges.
class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend(int device, std::byte* arena, uint64_t bytes)
      : device_(device), arena_(arena), bytes_(bytes) {}
  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaFree(arena_);
  }

  std::string name() const override { return absl::StrCat("cuda:", device_); }
  bool is_device() const override { return true; }
  std::byte* base() const override { return arena_; }
  uint64_t arena_bytes() const override { return bytes_; }

  absl::Status CopyIn(uint64_t offset, std::span<const std::byte> src) override {
    if (absl::Status s = CheckRange(offset, src.size()); !s.ok()) return s;
    KVCM_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    KVCM_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(arena_ + offset, src.data(), src.size(), cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }
  absl::Status CopyOut(uint64_t offset, std::span<std::byte> dst) const override {
    if (absl::Status s = CheckRange(offset, dst.size()); !s.ok()) return s;
    KVCM_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    KVCM_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(dst.data(), arena_ + offset, dst.size(), cudaMemcpyDeviceToHost));
    return absl::OkStatus();
  }

 private:
  const int device_;
  std::byte* const arena_;
  const uint64_t bytes_;
};

}  // namespace

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    // Clear the sticky "last error" so later calls are not confused by it.
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorName(err), " (",
                                               static_cast<int>(err), ")"));
  }
  return count;
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaBackend(int device_index,
                                                                 uint64_t arena_bytes) {
  KVCM_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_index));
  void* arena = nullptr;
  KVCM_CUDA_RETURN_IF_ERROR(cudaMalloc(&arena, arena_bytes));
  return std::make_unique<CudaBackend>(device_index, static_cast<std::byte*>(arena), arena_bytes);
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreatePinnedHostBackend(uint64_t arena_bytes) {
  if (arena_bytes < 1) return absl::InvalidArgumentError("arena_bytes must be >= 1");
  void* arena = nullptr;
  if (const cudaError_t err = cudaHostAlloc(&arena, arena_bytes, cudaHostAllocDefault);
      err != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it for later calls
    return absl::ResourceExhaustedError(absl::StrCat("cudaHostAlloc of ", arena_bytes,
                                                     " bytes: ", cudaGetErrorName(err), " (",
                                                     static_cast<int>(err), ")"));
  }
  return AdoptHostArena(static_cast<std::byte*>(arena), arena_bytes, "host-pinned",
                        [](std::byte* p) { cudaFreeHost(p); });
}

}  // namespace kvcm
