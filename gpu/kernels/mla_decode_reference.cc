#include "gpu/kernels/mla_decode_reference.h"

#include <math.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "gpu/kernels/fp8_latent.h"
#include "gpu/kernels/fp8_latent_cpu.h"
#include "gpu/kernels/mla_math.h"

namespace kvcm::gpu {

MlaTestProblem MakeMlaTestProblem(int heads, const std::vector<int>& seq_lens, int page_size,
                                  LatentDtype dtype, uint32_t seed, bool with_reference) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  MlaTestProblem p;
  p.batch = static_cast<int>(seq_lens.size());
  p.heads = heads;
  p.seq_lens.assign(seq_lens.begin(), seq_lens.end());

  int needed = 0, max_blocks = 1;
  for (int len : seq_lens) {
    const int blocks = (len + page_size - 1) / page_size;
    needed += blocks;
    max_blocks = std::max(max_blocks, blocks);
  }
  const int num_blocks = needed + 5;  // spare blocks hold garbage no sequence may read
  const int stride = max_blocks + 1;  // a padded block table row
  std::vector<int32_t> order(num_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  p.block_table.assign(static_cast<size_t>(p.batch) * stride, -7);
  int next = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int blocks = (seq_lens[b] + page_size - 1) / page_size;
    for (int i = 0; i < blocks; ++i) p.block_table[b * stride + i] = order[next++];
  }

  // Garbage (50) everywhere, then each sequence's tokens: a read of a slot past seq_len or
  // of a block the sequence does not own shows up as a large error.
  const int64_t pool_tokens = int64_t{num_blocks} * page_size;
  p.bf16_pool.assign(pool_tokens * kMlaHeadDim, FloatToBf16(50.0f));
  for (int b = 0; b < p.batch; ++b) {
    for (int t = 0; t < seq_lens[b]; ++t) {
      const int64_t row =
          int64_t{p.block_table[b * stride + t / page_size]} * page_size + t % page_size;
      for (int d = 0; d < kMlaHeadDim; ++d) {
        p.bf16_pool[row * kMlaHeadDim + d] = FloatToBf16(unit(rng));
      }
    }
  }

  p.q.resize(static_cast<size_t>(p.batch) * heads * kMlaHeadDim);
  if (with_reference) {
    p.w_uk.resize(static_cast<size_t>(heads) * kNopeHeadDim * kMlaLatentDim);
    p.w_uv.resize(static_cast<size_t>(heads) * kMlaLatentDim * kVHeadDim);
    for (float& w : p.w_uk) w = 0.1f * unit(rng);
    for (float& w : p.w_uv) w = 0.1f * unit(rng);
    p.q_nope.resize(static_cast<size_t>(p.batch) * heads * kNopeHeadDim);
    p.q_rope.resize(static_cast<size_t>(p.batch) * heads * kMlaRopeDim);
    for (float& x : p.q_nope) x = 3.0f * unit(rng);
    for (float& x : p.q_rope) x = 3.0f * unit(rng);
    // Absorption: q_latent[d] = sum_n q_nope[n] * W_uk[h, n, d].
    for (int b = 0; b < p.batch; ++b) {
      for (int h = 0; h < heads; ++h) {
        const float* qn = &p.q_nope[(static_cast<size_t>(b) * heads + h) * kNopeHeadDim];
        const float* w = &p.w_uk[static_cast<size_t>(h) * kNopeHeadDim * kMlaLatentDim];
        uint16_t* qh = &p.q[(static_cast<size_t>(b) * heads + h) * kMlaHeadDim];
        for (int d = 0; d < kMlaLatentDim; ++d) {
          double s = 0;
          for (int n = 0; n < kNopeHeadDim; ++n) s += double{qn[n]} * w[n * kMlaLatentDim + d];
          qh[d] = FloatToBf16(static_cast<float>(s));
        }
        const float* qr = &p.q_rope[(static_cast<size_t>(b) * heads + h) * kMlaRopeDim];
        for (int r = 0; r < kMlaRopeDim; ++r) qh[kMlaLatentDim + r] = FloatToBf16(qr[r]);
      }
    }
  } else {
    for (uint16_t& x : p.q) x = FloatToBf16(unit(rng));
  }

  p.out.assign(static_cast<size_t>(p.batch) * heads * kMlaLatentDim, 0);
  p.lse.assign(static_cast<size_t>(p.batch) * heads, 0.0f);

  MlaDecodeParams& m = p.params;
  m.dtype = dtype;
  if (dtype == LatentDtype::kFp8E4m3) {
    p.fp8_pool.resize(pool_tokens * kFp8TokenBytes);
    QuantizeLatentsFp8Cpu(p.bf16_pool.data(), pool_tokens, p.fp8_pool.data());
    m.kv_cache = p.fp8_pool.data();
  } else {
    m.kv_cache = p.bf16_pool.data();
  }
  m.kv_block_stride_bytes = int64_t{page_size} * MlaTokenBytes(m);
  m.block_table = p.block_table.data();
  m.block_table_stride = stride;
  m.seq_lens = p.seq_lens.data();
  m.q = p.q.data();
  m.q_head_stride = kMlaHeadDim;
  m.q_batch_stride = int64_t{heads} * kMlaHeadDim;
  m.out = p.out.data();
  m.out_head_stride = kMlaLatentDim;
  m.out_batch_stride = int64_t{heads} * kMlaLatentDim;
  m.lse = p.lse.data();
  m.batch = p.batch;
  m.num_heads = heads;
  m.num_blocks = num_blocks;
  m.page_size = page_size;
  m.max_blocks_per_seq = max_blocks;
  m.softmax_scale = 1.0f / sqrtf(static_cast<float>(kNopeHeadDim + kMlaRopeDim));
  return p;
}

namespace {

const uint16_t* TokenOf(const MlaTestProblem& p, int b, int t) {
  const int64_t block = p.block_table[b * p.params.block_table_stride + t / p.params.page_size];
  return &p.bf16_pool[(block * p.params.page_size + t % p.params.page_size) * kMlaHeadDim];
}

}  // namespace

std::vector<double> NaiveMlaAttention(const MlaTestProblem& p, int b, int h, double* lse) {
  const int len = p.seq_lens[b];
  const float* qn = &p.q_nope[(static_cast<size_t>(b) * p.heads + h) * kNopeHeadDim];
  const float* qr = &p.q_rope[(static_cast<size_t>(b) * p.heads + h) * kMlaRopeDim];
  const float* wk = &p.w_uk[static_cast<size_t>(h) * kNopeHeadDim * kMlaLatentDim];
  const float* wv = &p.w_uv[static_cast<size_t>(h) * kMlaLatentDim * kVHeadDim];
  std::vector<double> score(len), latent(kMlaLatentDim);
  std::vector<std::vector<double>> value(len, std::vector<double>(kVHeadDim, 0.0));
  double max_score = -INFINITY;
  for (int t = 0; t < len; ++t) {
    const uint16_t* tok = TokenOf(p, b, t);
    for (int d = 0; d < kMlaLatentDim; ++d) latent[d] = Bf16ToFloat(tok[d]);
    double s = 0;
    for (int n = 0; n < kNopeHeadDim; ++n) {  // K_nope[n] = latent . W_uk[h, n, :]
      double k = 0;
      for (int d = 0; d < kMlaLatentDim; ++d) k += latent[d] * wk[n * kMlaLatentDim + d];
      s += qn[n] * k;
    }
    for (int r = 0; r < kMlaRopeDim; ++r) s += double{qr[r]} * Bf16ToFloat(tok[kMlaLatentDim + r]);
    score[t] = s * p.params.softmax_scale;
    max_score = std::max(max_score, score[t]);
    for (int d = 0; d < kMlaLatentDim; ++d) {  // V = latent . W_uv[h]
      for (int v = 0; v < kVHeadDim; ++v) value[t][v] += latent[d] * wv[d * kVHeadDim + v];
    }
  }
  std::vector<double> out(kVHeadDim, 0.0);
  double sum = 0;
  for (int t = 0; t < len; ++t) sum += exp(score[t] - max_score);
  for (int t = 0; t < len; ++t) {
    const double w = exp(score[t] - max_score) / sum;
    for (int v = 0; v < kVHeadDim; ++v) out[v] += w * value[t][v];
  }
  *lse = len > 0 ? max_score + log(sum) : -INFINITY;
  return out;
}

std::vector<double> ProjectLatentOutput(const MlaTestProblem& p, int b, int h) {
  const uint16_t* o = &p.out[(static_cast<size_t>(b) * p.heads + h) * kMlaLatentDim];
  const float* wv = &p.w_uv[static_cast<size_t>(h) * kMlaLatentDim * kVHeadDim];
  std::vector<double> out(kVHeadDim, 0.0);
  for (int d = 0; d < kMlaLatentDim; ++d) {
    const double x = Bf16ToFloat(o[d]);
    for (int v = 0; v < kVHeadDim; ++v) out[v] += x * wv[d * kVHeadDim + v];
  }
  return out;
}

}  // namespace kvcm::gpu
