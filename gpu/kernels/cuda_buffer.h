// DeviceBuffer: one cudaMalloc allocation owned by host code (the kernel drivers in
// cuda_runner.cc and the agent's device attention path). CUDA runtime only, no kernels;
// include only where KVCM_CUDA_ENABLED code is compiled. Errors are absl::Status values
// through KVCM_CUDA_RETURN_IF_ERROR (cuda_status.h).
#ifndef KVCM_GPU_KERNELS_CUDA_BUFFER_H_
#define KVCM_GPU_KERNELS_CUDA_BUFFER_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "gpu/kernels/cuda_status.h"

namespace kvcm::gpu {

// Owns one device allocation, freed (cudaFree) on destruction; not copyable. Not
// thread-safe. Free does not wait for work queued on a stream: whoever queues work on the
// buffer keeps it alive until that work is done.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }

  // cudaMalloc of `bytes`; 0 bytes allocates a 16-byte placeholder, so that get() is never
  // null after success (the launchers reject null pointers). REQUIRES: nothing allocated yet.
  absl::Status Allocate(size_t bytes) {
    KVCM_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, bytes == 0 ? 16 : bytes));
    return absl::OkStatus();
  }
  // Allocate(bytes), then a synchronous copy of `bytes` bytes from `host` into them.
  absl::Status CopyFrom(const void* host, size_t bytes) {
    if (absl::Status s = Allocate(bytes); !s.ok()) return s;
    KVCM_CUDA_RETURN_IF_ERROR(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }
  // Allocate(bytes), then queues the copy of `host` into them on `stream`: `host` must
  // stay valid until the stream has run it.
  absl::Status CopyFromAsync(const void* host, size_t bytes, cudaStream_t stream) {
    if (absl::Status s = Allocate(bytes); !s.ok()) return s;
    KVCM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ptr_, host, bytes, cudaMemcpyHostToDevice, stream));
    return absl::OkStatus();
  }

  template <typename T>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_CUDA_BUFFER_H_
