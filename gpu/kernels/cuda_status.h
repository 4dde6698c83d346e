// The one place a CUDA runtime error becomes an absl::Status (STYLE.md: one error type in
// host code). Launchers return cudaError_t; host code wraps every call in
// KVCM_CUDA_RETURN_IF_ERROR, which returns the Status and never exits.
#ifndef KVCM_GPU_KERNELS_CUDA_STATUS_H_
#define KVCM_GPU_KERNELS_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvcm::gpu {

// cudaErrorInvalidValue -> INVALID_ARGUMENT, cudaErrorMemoryAllocation -> RESOURCE_EXHAUSTED,
// no device / no driver -> UNAVAILABLE, anything else -> INTERNAL. The message names the
// call, the CUDA error and where it happened.
inline absl::Status CudaErrorToStatus(cudaError_t err, const char* expr, const char* file,
                                      int line) {
  const std::string msg = absl::StrCat(expr, ": ", cudaGetErrorName(err), " (",
                                       cudaGetErrorString(err), ") at ", file, ":", line);
  switch (err) {
    case cudaSuccess:
      return absl::OkStatus();
    case cudaErrorInvalidValue:
      return absl::InvalidArgumentError(msg);
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace kvcm::gpu

#define KVCM_CUDA_RETURN_IF_ERROR(expr)                                                 \
  do {                                                                                  \
    const cudaError_t kvcm_cuda_err_ = (expr);                                          \
    if (kvcm_cuda_err_ != cudaSuccess) {                                                \
      return ::kvcm::gpu::CudaErrorToStatus(kvcm_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                                   \
  } while (0)

#endif  // KVCM_GPU_KERNELS_CUDA_STATUS_H_
