// Host-side drivers that run the CUDA kernels on host data (copy in, launch `iterations`
// times, time with CUDA events, copy out): shared by kvcm_kernels_cuda_test and
// kvcm-gpu-check. Not thread-safe across threads sharing a device's default stream.
#ifndef KVCM_GPU_KERNELS_CUDA_RUNNER_H_
#define KVCM_GPU_KERNELS_CUDA_RUNNER_H_

#include <stdint.h>

#include <vector>

#include "absl/status/status.h"
#include "gpu/kernels/mla_decode_reference.h"

namespace kvcm::gpu {

// OK when at least one CUDA device is usable; otherwise UNAVAILABLE with the runtime's
// reason (any cudaGetDeviceCount error counts as "no device", e.g. 35 with no driver).
absl::Status CudaDeviceStatus();

// Runs prob.params (kv cache per its dtype) on the device; *out [batch, heads, 512] bf16,
// *lse [batch, heads]; *us_per_iter the mean over `iterations` launches (>= 1).
absl::Status RunMlaDecodeCuda(const MlaTestProblem& prob, int iterations,
                              std::vector<uint16_t>* out, std::vector<float>* lse,
                              double* us_per_iter);

// in [num_tokens, 576] bf16 -> *out [num_tokens, 656] bytes.
absl::Status RunQuantizeLatentsFp8Cuda(const std::vector<uint16_t>& in, int64_t num_tokens,
                                       int iterations, std::vector<uint8_t>* out,
                                       double* us_per_iter);
// in [num_tokens, 656] bytes -> *out [num_tokens, 576] bf16.
absl::Status RunDequantizeLatentsFp8Cuda(const std::vector<uint8_t>& in, int64_t num_tokens,
                                         int iterations, std::vector<uint16_t>* out,
                                         double* us_per_iter);

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_CUDA_RUNNER_H_
