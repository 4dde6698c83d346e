#include "gpu/kernels/cuda_runner.h"

#include <cuda_runtime_api.h>

#include <functional>

#include "absl/strings/str_cat.h"
#include "gpu/kernels/cuda_buffer.h"
#include "gpu/kernels/cuda_status.h"
#include "gpu/kernels/fp8_latent.h"
#include "gpu/kernels/mla_decode_api.h"
#include "gpu/kernels/mla_math.h"

namespace kvcm::gpu {
namespace {

// Runs `launch` once to warm up, then `iterations` times between two events.
absl::Status TimeLaunches(int iterations, const std::function<absl::Status()>& launch,
                          double* us_per_iter) {
  if (absl::Status s = launch(); !s.ok()) return s;
  KVCM_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  KVCM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  KVCM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  absl::Status status = absl::OkStatus();
  cudaEventRecord(start);
  for (int i = 0; i < iterations && status.ok(); ++i) status = launch();
  cudaEventRecord(stop);
  const cudaError_t err = cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!status.ok()) return status;
  KVCM_CUDA_RETURN_IF_ERROR(err);
  *us_per_iter = 1000.0 * ms / (iterations > 0 ? iterations : 1);
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaDeviceStatus() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cudaGetDeviceCount: error ", static_cast<int>(err),
                                               " ", cudaGetErrorName(err), ": ",
                                               cudaGetErrorString(err)));
  }
  if (count == 0) return absl::UnavailableError("cudaGetDeviceCount: 0 devices");
  return absl::OkStatus();
}

absl::Status RunMlaDecodeCuda(const MlaTestProblem& prob, int iterations,
                              std::vector<uint16_t>* out, std::vector<float>* lse,
                              double* us_per_iter) {
  const MlaDecodeParams& hp = prob.params;
  const bool fp8 = hp.dtype == LatentDtype::kFp8E4m3;
  DeviceBuffer kv, table, lens, q, d_out, d_lse;
  const size_t kv_bytes = fp8 ? prob.fp8_pool.size() : prob.bf16_pool.size() * 2;
  if (absl::Status s = kv.CopyFrom(hp.kv_cache, kv_bytes); !s.ok()) return s;
  if (absl::Status s = table.CopyFrom(prob.block_table.data(), prob.block_table.size() * 4);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = lens.CopyFrom(prob.seq_lens.data(), prob.seq_lens.size() * 4); !s.ok()) {
    return s;
  }
  if (absl::Status s = q.CopyFrom(prob.q.data(), prob.q.size() * 2); !s.ok()) return s;
  if (absl::Status s = d_out.Allocate(prob.out.size() * 2); !s.ok()) return s;
  if (absl::Status s = d_lse.Allocate(prob.lse.size() * 4); !s.ok()) return s;

  MlaDecodeParams dp = hp;
  dp.kv_cache = kv.get<void>();
  dp.block_table = table.get<int32_t>();
  dp.seq_lens = lens.get<int32_t>();
  dp.q = q.get<uint16_t>();
  dp.out = d_out.get<uint16_t>();
  dp.lse = d_lse.get<float>();
  if (absl::Status s = TimeLaunches(
          iterations,
          [&] { return MlaDecodeCuda(dp, prob.block_table.data(), prob.seq_lens.data(), nullptr); },
          us_per_iter);
      !s.ok()) {
    return s;
  }
  out->resize(prob.out.size());
  lse->resize(prob.lse.size());
  KVCM_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(out->data(), dp.out, out->size() * 2, cudaMemcpyDeviceToHost));
  KVCM_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(lse->data(), dp.lse, lse->size() * 4, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status RunQuantizeLatentsFp8Cuda(const std::vector<uint16_t>& in, int64_t num_tokens,
                                       int iterations, std::vector<uint8_t>* out,
                                       double* us_per_iter) {
  DeviceBuffer d_in, d_out;
  if (absl::Status s = d_in.CopyFrom(in.data(), num_tokens * kBf16TokenBytes); !s.ok()) return s;
  if (absl::Status s = d_out.Allocate(num_tokens * kFp8TokenBytes); !s.ok()) return s;
  if (absl::Status s = TimeLaunches(
          iterations,
          [&] {
            return QuantizeLatentsFp8Cuda(d_in.get<uint16_t>(), num_tokens, d_out.get<uint8_t>(),
                                          nullptr);
          },
          us_per_iter);
      !s.ok()) {
    return s;
  }
  out->resize(num_tokens * kFp8TokenBytes);
  KVCM_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(out->data(), d_out.get<void>(), out->size(), cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status RunDequantizeLatentsFp8Cuda(const std::vector<uint8_t>& in, int64_t num_tokens,
                                         int iterations, std::vector<uint16_t>* out,
                                         double* us_per_iter) {
  DeviceBuffer d_in, d_out;
  if (absl::Status s = d_in.CopyFrom(in.data(), num_tokens * kFp8TokenBytes); !s.ok()) return s;
  if (absl::Status s = d_out.Allocate(num_tokens * kBf16TokenBytes); !s.ok()) return s;
  if (absl::Status s = TimeLaunches(
          iterations,
          [&] {
            return DequantizeLatentsFp8Cuda(d_in.get<uint8_t>(), num_tokens, d_out.get<uint16_t>(),
                                            nullptr);
          },
          us_per_iter);
      !s.ok()) {
    return s;
  }
  out->resize(num_tokens * kMlaHeadDim);
  KVCM_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(out->data(), d_out.get<void>(), out->size() * 2, cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

}  // namespace kvcm::gpu
