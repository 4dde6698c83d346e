// Random MLA decode problems for the tests, kvcm-gpu-check and the benchmark: a paged latent
// pool in shuffled block order with garbage in every slot no sequence owns, the un-absorbed
// query and the W_uk / W_uv projections, and the naive (MHA-shaped) reference.
#ifndef KVCM_GPU_KERNELS_MLA_DECODE_REFERENCE_H_
#define KVCM_GPU_KERNELS_MLA_DECODE_REFERENCE_H_

#include <stdint.h>

#include <vector>

#include "gpu/kernels/mla_decode_params.h"

namespace kvcm::gpu {

inline constexpr int kNopeHeadDim = 128;  // DeepSeek qk_nope_head_dim
inline constexpr int kVHeadDim = 128;     // DeepSeek v_head_dim

// Owns every buffer `params` points into (host memory). Movable, not copyable.
struct MlaTestProblem {
  int batch = 0;
  int heads = 0;
  std::vector<int32_t> seq_lens;     // [batch]
  std::vector<int32_t> block_table;  // [batch, block_table_stride]
  std::vector<uint16_t> bf16_pool;   // [num_blocks, page_size, 576] unquantised latents
  std::vector<uint8_t> fp8_pool;     // [num_blocks, page_size, 656]; empty for bf16
  std::vector<uint16_t> q;           // [batch, heads, 576] absorbed query, bf16
  std::vector<uint16_t> out;         // [batch, heads, 512] bf16
  std::vector<float> lse;            // [batch, heads]
  // Only with_reference: the un-absorbed model side.
  std::vector<float> w_uk;    // [heads, 128 nope, 512 latent]
  std::vector<float> w_uv;    // [heads, 512 latent, 128 v]
  std::vector<float> q_nope;  // [batch, heads, 128]
  std::vector<float> q_rope;  // [batch, heads, 64]
  MlaDecodeParams params;     // points into the vectors above; kv_cache per dtype

  MlaTestProblem() = default;
  MlaTestProblem(MlaTestProblem&&) = default;
  MlaTestProblem& operator=(MlaTestProblem&&) = default;
};

// softmax_scale = 1 / sqrt(128 + 64). Draws the same numbers for both dtypes, so two
// problems with equal arguments but different dtypes hold the same latents. Without
// with_reference the query is drawn directly in the latent space (cheap, for large sizes).
MlaTestProblem MakeMlaTestProblem(int heads, const std::vector<int>& seq_lens, int page_size,
                                  LatentDtype dtype, uint32_t seed, bool with_reference = true);

// Naive attention of (b, h) in V space [128] from the unquantised latents: K_nope =
// latent . W_uk^T, V = latent . W_uv, scores from [q_nope, q_rope]; *lse gets the natural
// log-sum-exp of the scaled scores. REQUIRES: made with_reference.
std::vector<double> NaiveMlaAttention(const MlaTestProblem& prob, int b, int h, double* lse);

// out[b, h, :] (latent space, bf16) . W_uv[h] -> [128].
std::vector<double> ProjectLatentOutput(const MlaTestProblem& prob, int b, int h);

}  // namespace kvcm::gpu

#endif  // KVCM_GPU_KERNELS_MLA_DECODE_REFERENCE_H_
