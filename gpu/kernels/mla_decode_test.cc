// CPU tests of MLA decode with matrix absorption, the shared math helpers and the FP8 latent
// layout. The CUDA kernels are compared with these CPU twins in mla_decode_cuda_test.cc.
#include <math.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gpu/kernels/fp8_latent.h"
#include "gpu/kernels/fp8_latent_cpu.h"
#include "gpu/kernels/mla_decode_cpu.h"
#include "gpu/kernels/mla_decode_reference.h"
#include "gpu/kernels/mla_math.h"
#include "gtest/gtest.h"

namespace kvcm::gpu {
namespace {

TEST(MlaMathTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even mantissa (1.0).
  EXPECT_EQ(FloatToBf16(1.0f + 0.00390625f), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0.00390625f), 0x3f82);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_TRUE(isnan(Bf16ToFloat(FloatToBf16(NAN))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (!isnan(f)) {
      ASSERT_EQ(FloatToBf16(f), h) << h;
    }
  }
}

TEST(MlaMathTest, E4m3DecodesEveryCodeAndEncodesItBack) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float f = E4m3ToFloat(code);
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(isnan(f)) << c;
      continue;
    }
    const int exp = (c >> 3) & 0xf, mant = c & 7;
    const double mag =
        exp == 0 ? mant * std::ldexp(1.0, -9) : (1 + mant / 8.0) * std::ldexp(1.0, exp - 7);
    EXPECT_EQ(f, (c & 0x80) ? -mag : mag) << c;
    EXPECT_EQ(FloatToE4m3(f), code) << c;
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
}

TEST(MlaMathTest, E4m3RoundsTiesToEvenAndSaturates) {
  EXPECT_EQ(E4m3ToFloat(FloatToE4m3(1.0625f)), 1.0f);   // between 1 and 1.125: even is 1
  EXPECT_EQ(E4m3ToFloat(FloatToE4m3(1.1875f)), 1.25f);  // between 1.125 and 1.25: even is 1.25
  EXPECT_EQ(E4m3ToFloat(FloatToE4m3(1.07f)), 1.125f);
  EXPECT_EQ(E4m3ToFloat(FloatToE4m3(15.5f)), 16.0f);  // carry into the exponent
  EXPECT_EQ(FloatToE4m3(1000.0f), 0x7e);
  EXPECT_EQ(FloatToE4m3(-INFINITY), 0xfe);
  EXPECT_EQ(FloatToE4m3(NAN), 0x7f);
  // Subnormals: quantum 2^-9; 2.5 * 2^-9 ties to 2 * 2^-9, 3.5 * 2^-9 to 4 * 2^-9.
  EXPECT_EQ(FloatToE4m3(2.5f / 512), 0x02);
  EXPECT_EQ(FloatToE4m3(3.5f / 512), 0x04);
  EXPECT_EQ(FloatToE4m3(7.75f / 512), 0x08);  // rounds up into the smallest normal
  EXPECT_EQ(FloatToE4m3(0.1f / 512), 0x00);
}

TEST(MlaMathTest, SoftmaxMergeOfTwoHalvesEqualsTheWhole) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-20, 20);
  std::vector<float> s(100), v(100);
  for (int i = 0; i < 100; ++i) s[i] = u(rng), v[i] = u(rng);
  auto run = [&](int lo, int hi, SoftmaxState& st, float& acc) {
    st = EmptySoftmaxState();
    acc = 0;
    for (int i = lo; i < hi; ++i) {
      acc *= SoftmaxRaiseMax(st, s[i]);
      acc += SoftmaxAccept(st, s[i]) * v[i];
    }
  };
  SoftmaxState whole, a, b, empty = EmptySoftmaxState();
  float acc_whole, acc_a, acc_b;
  run(0, 100, whole, acc_whole);
  run(0, 37, a, acc_a);
  run(37, 100, b, acc_b);
  float sa, sb;
  SoftmaxMerge(a, b, &sa, &sb);
  EXPECT_NEAR(acc_a * sa + acc_b * sb, acc_whole, 1e-4f * fabsf(acc_whole));
  EXPECT_NEAR(SoftmaxLse(a), SoftmaxLse(whole), 1e-5f);
  SoftmaxMerge(a, empty, &sa, &sb);
  EXPECT_EQ(sa, 1.0f);
  EXPECT_EQ(sb, 0.0f);
  SoftmaxMerge(empty, a, &sa, &sb);
  EXPECT_EQ(sa, 0.0f);
  EXPECT_EQ(sb, 1.0f);
  EXPECT_EQ(SoftmaxLse(EmptySoftmaxState()), -INFINITY);
}

TEST(Fp8LatentTest, RoundTripErrorIsBoundedPerGroup) {
  std::mt19937 rng(11);
  const int64_t n = 64;
  std::vector<uint16_t> in(n * kMlaHeadDim);
  std::normal_distribution<float> g(0, 1);
  for (int64_t t = 0; t < n; ++t) {
    for (int d = 0; d < kMlaHeadDim; ++d) {
      // Groups of very different magnitude, and one all-zero group, share a token.
      const int group = d / kFp8GroupSize;
      const float mag = group == 3 && t % 5 == 0 ? 0.0f : std::ldexp(1.0f, 3 * group - 4);
      in[t * kMlaHeadDim + d] = FloatToBf16(g(rng) * mag);
    }
  }
  std::vector<uint8_t> q(n * kFp8TokenBytes);
  std::vector<uint16_t> back(n * kMlaHeadDim);
  QuantizeLatentsFp8Cpu(in.data(), n, q.data());
  DequantizeLatentsFp8Cpu(q.data(), n, back.data());
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* token = &q[t * kFp8TokenBytes];
    for (int grp = 0; grp < kFp8NumScales; ++grp) {
      float amax = 0;
      for (int i = 0; i < kFp8GroupSize; ++i) {
        amax = std::max(amax, fabsf(Bf16ToFloat(in[t * kMlaHeadDim + grp * kFp8GroupSize + i])));
      }
      const float scale = Fp8TokenScale(token, grp);
      EXPECT_EQ(scale, amax > 0 ? amax / 448.0f : 1.0f);
      for (int i = 0; i < kFp8GroupSize; ++i) {
        const int d = grp * kFp8GroupSize + i;
        const float x = Bf16ToFloat(in[t * kMlaHeadDim + d]);
        const float y = Fp8TokenDim(token, d);
        // e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value for normals, and
        // 2^-10 * scale below the smallest normal (2^-6 * scale).
        const float bound = std::max(fabsf(x) * 0.0625f, scale * 0.0009765625f);
        ASSERT_LE(fabsf(x - y), bound) << "token " << t << " dim " << d;
        // The bf16 dequantisation adds at most half a bf16 ulp (2^-8 relative).
        ASSERT_LE(fabsf(Bf16ToFloat(back[t * kMlaHeadDim + d]) - y), fabsf(y) * 0.00390625f);
        if (amax == 0) {
          ASSERT_EQ(y, 0.0f);
        }
      }
    }
    for (int r = 0; r < kMlaRopeDim; ++r) {  // rope is copied bit for bit both ways
      ASSERT_EQ(Fp8TokenRope(token, r), in[t * kMlaHeadDim + kMlaLatentDim + r]);
      ASSERT_EQ(back[t * kMlaHeadDim + kMlaLatentDim + r], in[t * kMlaHeadDim + kMlaLatentDim + r]);
    }
  }
}

// Absorbed decode (latent output projected by W_uv) against naive MHA-shaped attention with
// per-head K = [latent . W_uk^T, rope] and V = latent . W_uv, from the un-absorbed query.
// Tolerance: max |absorbed - naive| <= rel * max |naive| per head. bf16: rel 1e-2 (query,
// output and latents in bf16). fp8: rel 1e-1 (measured up to 6.5e-2 here), the e4m3
// latents' error (up to 2^-4 of each value, through the scores and the values) against a
// reference built from the unquantised latents; the tight check of the fp8 path is
// Fp8DecodeMatchesBf16DecodeOfDequantisedLatents (rel 1e-2).
struct AbsorptionCase {
  int heads;
  std::vector<int> seq_lens;
  int page_size;
  LatentDtype dtype;
  double rel_tol;
  double lse_tol;
};

void ExpectAbsorbedEqualsNaive(const AbsorptionCase& c) {
  MlaTestProblem prob = MakeMlaTestProblem(c.heads, c.seq_lens, c.page_size, c.dtype, 1234);
  ASSERT_TRUE(MlaDecodeCpu(prob.params).ok());
  for (int b = 0; b < prob.batch; ++b) {
    for (int h = 0; h < c.heads; ++h) {
      double ref_lse = 0;
      const std::vector<double> ref = NaiveMlaAttention(prob, b, h, &ref_lse);
      const std::vector<double> got = ProjectLatentOutput(prob, b, h);
      double max_ref = 0, max_err = 0;
      for (size_t v = 0; v < ref.size(); ++v) {
        max_ref = std::max(max_ref, std::abs(ref[v]));
        max_err = std::max(max_err, std::abs(ref[v] - got[v]));
      }
      ASSERT_GT(max_ref, 0.0);
      ASSERT_LE(max_err, c.rel_tol * max_ref) << "batch " << b << " head " << h;
      ASSERT_NEAR(prob.lse[b * c.heads + h], ref_lse, c.lse_tol) << "batch " << b << " head " << h;
    }
  }
}

TEST(MlaDecodeCpuTest, AbsorbedEqualsNaiveBf16Heads16) {
  // Page 16: 1 token, a length ending mid-block, one ending on a block edge, 6+ blocks.
  ExpectAbsorbedEqualsNaive({16, {1, 37, 48, 101}, 16, LatentDtype::kBf16, 1e-2, 1e-2});
}

TEST(MlaDecodeCpuTest, AbsorbedEqualsNaiveBf16Heads128) {
  ExpectAbsorbedEqualsNaive({128, {23, 70}, 16, LatentDtype::kBf16, 1e-2, 1e-2});
}

TEST(MlaDecodeCpuTest, AbsorbedEqualsNaiveBf16Page64) {
  ExpectAbsorbedEqualsNaive({16, {200, 65}, 64, LatentDtype::kBf16, 1e-2, 1e-2});
}

TEST(MlaDecodeCpuTest, AbsorbedEqualsNaiveFp8Heads16) {
  ExpectAbsorbedEqualsNaive({16, {1, 37, 101}, 16, LatentDtype::kFp8E4m3, 1e-1, 1e-1});
}

TEST(MlaDecodeCpuTest, AbsorbedEqualsNaiveFp8Heads128) {
  ExpectAbsorbedEqualsNaive({128, {23, 70}, 16, LatentDtype::kFp8E4m3, 1e-1, 1e-1});
}

TEST(MlaDecodeCpuTest, Fp8DecodeMatchesBf16DecodeOfDequantisedLatents) {
  MlaTestProblem fp8 = MakeMlaTestProblem(16, {45, 9}, 16, LatentDtype::kFp8E4m3, 99);
  ASSERT_TRUE(MlaDecodeCpu(fp8.params).ok());
  // The same problem over the fp8 pool dequantised to bf16.
  MlaTestProblem bf16 = MakeMlaTestProblem(16, {45, 9}, 16, LatentDtype::kBf16, 99);
  const int64_t tokens = int64_t{bf16.params.num_blocks} * bf16.params.page_size;
  DequantizeLatentsFp8Cpu(fp8.fp8_pool.data(), tokens, bf16.bf16_pool.data());
  ASSERT_TRUE(MlaDecodeCpu(bf16.params).ok());
  float max_ref = 0, max_err = 0;
  for (size_t i = 0; i < fp8.out.size(); ++i) {
    max_ref = std::max(max_ref, fabsf(Bf16ToFloat(bf16.out[i])));
    max_err = std::max(max_err, fabsf(Bf16ToFloat(bf16.out[i]) - Bf16ToFloat(fp8.out[i])));
  }
  EXPECT_LE(max_err, 1e-2f * max_ref);
}

TEST(MlaDecodeCpuTest, EmptySequenceGivesZerosAndMinusInfLse) {
  MlaTestProblem prob = MakeMlaTestProblem(16, {0, 5}, 16, LatentDtype::kBf16, 5);
  ASSERT_TRUE(MlaDecodeCpu(prob.params).ok());
  for (int d = 0; d < kMlaLatentDim; ++d) ASSERT_EQ(Bf16ToFloat(prob.out[d]), 0.0f);
  EXPECT_EQ(prob.lse[0], -INFINITY);
  EXPECT_TRUE(isfinite(prob.lse[16]));
}

TEST(MlaDecodeCpuTest, RefusesBadGeometryNamingTheField) {
  const MlaTestProblem prob = MakeMlaTestProblem(16, {20, 33}, 16, LatentDtype::kBf16, 3);
  auto expect_refused = [&](MlaDecodeParams p, const std::string& field) {
    const absl::Status s = MlaDecodeCpu(p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field << ": " << s;
    EXPECT_NE(s.message().find(field), absl::string_view::npos) << s;
  };
  MlaDecodeParams p = prob.params;
  ASSERT_TRUE(ValidateMlaDecodeParams(p, p.block_table, p.seq_lens).ok());
  p.page_size = 0;
  expect_refused(p, "page_size");
  p = prob.params;
  p.kv_cache = nullptr;
  expect_refused(p, "kv_cache");
  p = prob.params;
  p.q = nullptr;
  expect_refused(p, "q");
  p = prob.params;
  p.out = nullptr;
  expect_refused(p, "out");
  p = prob.params;
  p.block_table = nullptr;
  expect_refused(p, "block_table");
  p = prob.params;
  p.seq_lens = nullptr;
  expect_refused(p, "seq_lens");
  p = prob.params;
  p.num_heads = 0;
  expect_refused(p, "num_heads");
  p = prob.params;
  p.softmax_scale = NAN;
  expect_refused(p, "softmax_scale");
  p = prob.params;
  p.kv_block_stride_bytes = 100;
  expect_refused(p, "kv_block_stride_bytes");

  MlaTestProblem fp8 = MakeMlaTestProblem(16, {20, 33}, 16, LatentDtype::kFp8E4m3, 3);
  p = fp8.params;
  p.kv_lora_rank = 256;
  expect_refused(p, "kv_lora_rank");

  // Block id out of range, and a seq_len longer than its blocks can hold.
  MlaTestProblem bad = MakeMlaTestProblem(16, {20, 33}, 16, LatentDtype::kBf16, 3);
  bad.block_table[bad.params.block_table_stride + 2] = bad.params.num_blocks;
  expect_refused(bad.params, "block_table");
  bad.block_table[bad.params.block_table_stride + 2] = -1;
  expect_refused(bad.params, "block_table");
  bad = MakeMlaTestProblem(16, {20, 33}, 16, LatentDtype::kBf16, 3);
  bad.seq_lens[0] = bad.params.max_blocks_per_seq * bad.params.page_size + 1;
  expect_refused(bad.params, "seq_lens");
  bad.seq_lens[0] = -1;
  expect_refused(bad.params, "seq_lens");
}

}  // namespace
}  // namespace kvcm::gpu
