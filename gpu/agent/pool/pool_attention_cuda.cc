// Built only when KVCM_CUDA_ENABLED: a host-compiled file linked with the CUDA runtime and
// kvcm_kernels_cuda (no kernels here).
#include "gpu/agent/pool/pool_attention_cuda.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "gpu/kernels/cuda_buffer.h"
#include "gpu/kernels/cuda_status.h"
#include "gpu/kernels/mla_decode_api.h"

namespace kvcm {
namespace {

// A non-blocking stream, synchronised and destroyed on destruction: declared after the
// buffers its work uses, it is destroyed first, so no buffer is freed under a running kernel
// even on an error path.
class OwnedStream {
 public:
  OwnedStream() = default;
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream() {
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  absl::Status Create() {
    KVCM_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return absl::OkStatus();
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace

absl::Status MlaDecodeOverDeviceCache(const gpu::MlaDecodeParams& p) {
  // The request was validated by RunMlaDecodeOnPool; these guard the sizes computed below.
  if (p.kv_cache == nullptr || p.block_table == nullptr || p.seq_lens == nullptr ||
      p.q == nullptr || p.out == nullptr || p.lse == nullptr || p.batch <= 0 || p.num_heads <= 0) {
    return absl::InvalidArgumentError("MlaDecodeParams: null pointer or empty batch");
  }
  // The launcher reports cudaGetLastError(), which is per thread: drop what an earlier failed
  // call on this (shared RPC) thread left there. A sticky error cannot be cleared and is
  // reported again by the calls below, as it should be.
  cudaGetLastError();
  // The arena's own device: the kernel must run where the cache is.
  cudaPointerAttributes attr{};
  KVCM_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, p.kv_cache));
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return absl::FailedPreconditionError(
        absl::StrCat("MlaDecodeParams.kv_cache: not device memory (cudaMemoryType ",
                     static_cast<int>(attr.type), ")"));
  }
  KVCM_CUDA_RETURN_IF_ERROR(cudaSetDevice(attr.device));

  const size_t batch = static_cast<size_t>(p.batch);
  const size_t table_bytes = batch * static_cast<size_t>(p.block_table_stride) * sizeof(int32_t);
  const size_t lens_bytes = batch * sizeof(int32_t);
  const size_t q_bytes = batch * static_cast<size_t>(p.q_batch_stride) * sizeof(uint16_t);
  const size_t out_bytes = batch * static_cast<size_t>(p.out_batch_stride) * sizeof(uint16_t);
  const size_t lse_bytes = batch * static_cast<size_t>(p.num_heads) * sizeof(float);

  gpu::DeviceBuffer table, lens, q, out, lse;
  OwnedStream stream;  // after the buffers: see OwnedStream
  if (absl::Status s = stream.Create(); !s.ok()) return s;
  if (absl::Status s = table.CopyFromAsync(p.block_table, table_bytes, stream.get()); !s.ok())
    return s;
  if (absl::Status s = lens.CopyFromAsync(p.seq_lens, lens_bytes, stream.get()); !s.ok()) return s;
  if (absl::Status s = q.CopyFromAsync(p.q, q_bytes, stream.get()); !s.ok()) return s;
  if (absl::Status s = out.Allocate(out_bytes); !s.ok()) return s;
  if (absl::Status s = lse.Allocate(lse_bytes); !s.ok()) return s;

  gpu::MlaDecodeParams dp = p;
  dp.block_table = table.get<int32_t>();
  dp.seq_lens = lens.get<int32_t>();
  dp.q = q.get<uint16_t>();
  dp.out = out.get<uint16_t>();
  dp.lse = lse.get<float>();
  // p.block_table / p.seq_lens are the host copies MlaDecodeCuda range-checks.
  if (absl::Status s = gpu::MlaDecodeCuda(dp, p.block_table, p.seq_lens, stream.get()); !s.ok()) {
    return s;
  }
  KVCM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(p.out, dp.out, out_bytes, cudaMemcpyDeviceToHost, stream.get()));
  KVCM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(p.lse, dp.lse, lse_bytes, cudaMemcpyDeviceToHost, stream.get()));
  // A kernel fault surfaces here, before the pool's lock is released.
  KVCM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream.get()));
  return absl::OkStatus();
}

}  // namespace kvcm
