// CUDA kernels against their CPU twins. Label `gpu`; skips when no device is usable.
#include <math.h>

#include <algorithm>
#include <random>
#include <vector>

#include "gpu/kernels/cuda_runner.h"
#include "gpu/kernels/fp8_latent.h"
#include "gpu/kernels/fp8_latent_cpu.h"
#include "gpu/kernels/mla_decode_cpu.h"
#include "gpu/kernels/mla_decode_reference.h"
#include "gpu/kernels/mla_math.h"
#include "gtest/gtest.h"

namespace kvcm::gpu {
namespace {

class MlaDecodeCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (absl::Status s = CudaDeviceStatus(); !s.ok()) GTEST_SKIP() << "no CUDA device: " << s;
  }
};

// CUDA vs CPU on the same latents: both round the output to bf16 from fp32 accumulators
// summed in different orders, so they may differ by about one bf16 ulp (2^-8 relative).
void ExpectCudaMatchesCpu(int heads, const std::vector<int>& seq_lens, int page_size,
                          LatentDtype dtype) {
  MlaTestProblem prob = MakeMlaTestProblem(heads, seq_lens, page_size, dtype, 77, false);
  std::vector<uint16_t> out;
  std::vector<float> lse;
  double us = 0;
  ASSERT_TRUE(RunMlaDecodeCuda(prob, 1, &out, &lse, &us).ok());
  ASSERT_TRUE(MlaDecodeCpu(prob.params).ok());
  float max_ref = 0, max_err = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    max_ref = std::max(max_ref, fabsf(Bf16ToFloat(prob.out[i])));
    max_err = std::max(max_err, fabsf(Bf16ToFloat(prob.out[i]) - Bf16ToFloat(out[i])));
  }
  EXPECT_LE(max_err, 1e-2f * max_ref);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (isinf(prob.lse[i])) {
      EXPECT_EQ(lse[i], prob.lse[i]) << i;
    } else {
      EXPECT_NEAR(lse[i], prob.lse[i], 1e-3f * (1 + fabsf(prob.lse[i]))) << i;
    }
  }
}

TEST_F(MlaDecodeCudaTest, Bf16Heads16) {
  ExpectCudaMatchesCpu(16, {0, 1, 37, 64, 300}, 64, LatentDtype::kBf16);
}
TEST_F(MlaDecodeCudaTest, Bf16Heads128) {
  ExpectCudaMatchesCpu(128, {23, 70, 129}, 16, LatentDtype::kBf16);
}
TEST_F(MlaDecodeCudaTest, Bf16HeadsNotMultipleOfFour) {
  ExpectCudaMatchesCpu(6, {50, 3}, 16, LatentDtype::kBf16);
}
TEST_F(MlaDecodeCudaTest, Fp8Heads16) {
  ExpectCudaMatchesCpu(16, {1, 37, 64, 300}, 64, LatentDtype::kFp8E4m3);
}
TEST_F(MlaDecodeCudaTest, Fp8Heads128) {
  ExpectCudaMatchesCpu(128, {23, 70, 129}, 16, LatentDtype::kFp8E4m3);
}

TEST_F(MlaDecodeCudaTest, Fp8QuantisationIsBitIdenticalToTheCpu) {
  const int64_t n = 1000;
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0, 1);
  std::vector<uint16_t> in(n * kMlaHeadDim);
  for (size_t i = 0; i < in.size(); ++i) in[i] = FloatToBf16(g(rng) * ((i / 128) % 7 + 0.01f));
  std::vector<uint8_t> cpu(n * kFp8TokenBytes), cuda;
  QuantizeLatentsFp8Cpu(in.data(), n, cpu.data());
  double us = 0;
  ASSERT_TRUE(RunQuantizeLatentsFp8Cuda(in, n, 1, &cuda, &us).ok());
  EXPECT_EQ(cuda, cpu);
  std::vector<uint16_t> cpu_back(n * kMlaHeadDim), cuda_back;
  DequantizeLatentsFp8Cpu(cpu.data(), n, cpu_back.data());
  ASSERT_TRUE(RunDequantizeLatentsFp8Cuda(cpu, n, 1, &cuda_back, &us).ok());
  EXPECT_EQ(cuda_back, cpu_back);
}

}  // namespace
}  // namespace kvcm::gpu
