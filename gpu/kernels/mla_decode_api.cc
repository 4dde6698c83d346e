#include "gpu/kernels/mla_decode_api.h"

#include "absl/strings/str_cat.h"
#include "gpu/kernels/cuda_status.h"
#include "gpu/kernels/mla_decode.h"
#include "gpu/kernels/mla_decode_cpu.h"
#include "gpu/kernels/mla_math.h"

namespace kvcm::gpu {
namespace {

bool Aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

absl::Status CheckFp8Args(const void* in, int64_t num_tokens, const void* out) {
  if (in == nullptr || out == nullptr) return absl::InvalidArgumentError("in/out: null");
  if (!Aligned(in, 8) || !Aligned(out, 8)) {
    return absl::InvalidArgumentError("in/out: must be 8-byte aligned");
  }
  if (num_tokens < 0 || num_tokens > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens: ", num_tokens, " out of range"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MlaDecodeCuda(const MlaDecodeParams& p, const int32_t* host_block_table,
                           const int32_t* host_seq_lens, cudaStream_t stream) {
  if (absl::Status s = ValidateMlaDecodeParams(p, host_block_table, host_seq_lens); !s.ok()) {
    return s;
  }
  if (p.kv_lora_rank != kMlaLatentDim || p.rope_dim != kMlaRopeDim) {
    return absl::InvalidArgumentError(absl::StrCat("MlaDecodeParams.kv_lora_rank: the CUDA kernel ",
                                                   "supports 512 + 64 rope, got ", p.kv_lora_rank,
                                                   " + ", p.rope_dim));
  }
  if (!Aligned(p.kv_cache, 16) || p.kv_block_stride_bytes % 16 != 0) {
    return absl::InvalidArgumentError("MlaDecodeParams.kv_block_stride_bytes: 16-byte alignment");
  }
  if (!Aligned(p.q, 4) || p.q_head_stride % 2 != 0 || p.q_batch_stride % 2 != 0) {
    return absl::InvalidArgumentError("MlaDecodeParams.q_head_stride: 4-byte alignment");
  }
  if (!Aligned(p.out, 8) || p.out_head_stride % 4 != 0 || p.out_batch_stride % 4 != 0) {
    return absl::InvalidArgumentError("MlaDecodeParams.out_head_stride: 8-byte alignment");
  }
  if (p.batch > 65535) return absl::InvalidArgumentError("MlaDecodeParams.batch: > 65535");
  KVCM_CUDA_RETURN_IF_ERROR(LaunchMlaDecode(p, stream));
  return absl::OkStatus();
}

absl::Status QuantizeLatentsFp8Cuda(const uint16_t* in, int64_t num_tokens, uint8_t* out,
                                    cudaStream_t stream) {
  if (absl::Status s = CheckFp8Args(in, num_tokens, out); !s.ok()) return s;
  KVCM_CUDA_RETURN_IF_ERROR(LaunchQuantizeLatentsFp8(in, num_tokens, out, stream));
  return absl::OkStatus();
}

absl::Status DequantizeLatentsFp8Cuda(const uint8_t* in, int64_t num_tokens, uint16_t* out,
                                      cudaStream_t stream) {
  if (absl::Status s = CheckFp8Args(in, num_tokens, out); !s.ok()) return s;
  KVCM_CUDA_RETURN_IF_ERROR(LaunchDequantizeLatentsFp8(in, num_tokens, out, stream));
  return absl::OkStatus();
}

}  // namespace kvcm::gpu
