// Parameters of MLA decode attention with matrix absorption over a paged latent cache.
// A plain struct of non-owning pointers, shared by the CUDA launcher (device pointers,
// mla_decode.h) and the CPU twin (host pointers, mla_decode_cpu.h). No CUDA headers.
#ifndef KVCM_GPU_KERNELS_MLA_DECODE_PARAMS_H_
#define KVCM_GPU_KERNELS_MLA_DECODE_PARAMS_H_

#include <stdint.h>

namespace kvcm::gpu {

enum class LatentDtype : uint8_t {
  kBf16 = 1,     // a token is kv_lora_rank + rope_dim bf16 values (1,152 B for 512 + 64)
  kFp8E4m3 = 2,  // FlashMLA's 656 B layout (fp8_latent.h); requires kv_lora_rank 512
};

// One decode step: every sequence b has one query token per head. With q_nope already
// multiplied by W_uk (absorbed), the query lives in the latent space, so
//   score[t] = softmax_scale * dot(q[b, h, 0:576], latent[t, 0:576])
//   out[b, h, :] = sum_t softmax(score)[t] * latent[t, 0:512]
//   lse[b, h] = log(sum_t exp(score[t]))            (natural log, of the scaled scores)
// and out is projected by W_uv outside. Token t of sequence b lives at row t % page_size of
// block block_table[b, t / page_size]. Strides are in elements unless the name says bytes.
struct MlaDecodeParams {
  // [num_blocks, page_size, kv_lora_rank + rope_dim] bf16 bits, or
  // [num_blocks, page_size, 656 B] for kFp8E4m3. Token rows are contiguous inside a block.
  const void* kv_cache = nullptr;
  int64_t kv_block_stride_bytes = 0;     // bytes between blocks (>= page_size * token bytes)
  const int32_t* block_table = nullptr;  // [batch, max_blocks_per_seq] block ids
  int64_t block_table_stride = 0;        // elements between sequences (>= max_blocks_per_seq)
  const int32_t* seq_lens = nullptr;     // [batch] tokens in the cache per sequence
  const uint16_t* q = nullptr;           // [batch, num_heads, kv_lora_rank + rope_dim] bf16
  int64_t q_batch_stride = 0;
  int64_t q_head_stride = 0;
  uint16_t* out = nullptr;  // [batch, num_heads, kv_lora_rank] bf16
  int64_t out_batch_stride = 0;
  int64_t out_head_stride = 0;
  float* lse = nullptr;  // [batch, num_heads] fp32, contiguous; may be null

  int batch = 0;
  int num_heads = 0;
  int num_blocks = 0;
  int page_size = 0;  // tokens per block
  int max_blocks_per_seq = 0;
  int kv_lora_rank = 512;
  int rope_dim = 64;
  LatentDtype dtype = LatentDtype::kBf16;
  float softmax_scale = 0.0f;  // DeepSeek: 1 / sqrt(qk_nope_head_dim + rope_dim)
};

// Bytes of one cached token for p's dtype and geometry.
inline int64_t MlaTokenBytes(const MlaDecodeParams& p) {
  return p.dtype == LatentDtype::kFp8E4m3 ? 656 : 2 * int64_t{p.kv_lora_rank + p.rope_dim};
}

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_MLA_DECODE_PARAMS_H_
