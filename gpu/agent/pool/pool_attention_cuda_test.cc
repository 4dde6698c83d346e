// RunMlaDecodeOnPool on a CUDA pool against the same contents in a host pool: the device
// path (pool_attention_cuda.cc) must agree with the CPU kernel. Label `gpu`; skips when no
// CUDA device is usable.
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "common/model_catalog.h"
#include "gpu/agent/pool/block_pool.h"
#include "gpu/agent/pool/device_backend.h"
#include "gpu/agent/pool/pool_attention.h"
#include "gpu/kernels/cuda_runner.h"
#include "gpu/kernels/mla_math.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"

namespace kvcm {
namespace {

class PoolAttentionCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (absl::Status s = gpu::CudaDeviceStatus(); !s.ok()) {
      GTEST_SKIP() << "no CUDA device, the device pool path is not exercised: " << s;
    }
  }
};

// Tolerance as mla_decode_test.cc for bf16 (and mla_decode_cuda_test.cc): both kernels round
// fp32 accumulators summed in different orders to bf16, so max |cuda - host| <= 1e-2 x
// max |host|; lse within 1e-3 x (1 + |lse|).
void ExpectCudaPoolMatchesHostPool(KvDtype dtype) {
  constexpr uint32_t kLayer = 3;
  constexpr uint64_t kEpoch = 5;
  absl::StatusOr<ModelSpec> spec = FindModel("deepseek-v3", dtype);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const PoolGeometry g{*spec, kMlaTestPoolBlocks};
  ASSERT_EQ(g.spec.page_size_tokens, 64u) << "ScatteredMlaRequest assumes 64-token pages";
  const std::vector<std::byte> bytes = MakeMlaPoolBytes(g, kLayer, 21);

  absl::StatusOr<std::unique_ptr<DeviceBackend>> host_backend = CreateHostBackend(g.pool_bytes());
  ASSERT_TRUE(host_backend.ok()) << host_backend.status();
  absl::StatusOr<std::unique_ptr<BlockPool>> host =
      MakeFilledPool(g, *std::move(host_backend), kEpoch, bytes);
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<std::unique_ptr<DeviceBackend>> cuda_backend =
      CreateCudaBackend(0, g.pool_bytes());
  ASSERT_TRUE(cuda_backend.ok()) << cuda_backend.status();
  absl::StatusOr<std::unique_ptr<BlockPool>> cuda =
      MakeFilledPool(g, *std::move(cuda_backend), kEpoch, bytes);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  ASSERT_TRUE((*cuda)->backend().is_device());

  const std::vector<uint16_t> query =
      RandomBf16(kScatteredBatch * kScatteredHeads * gpu::kMlaHeadDim, 22);
  const PoolAttentionRequest req = ScatteredMlaRequest(kLayer, kEpoch, query);
  absl::StatusOr<PoolAttentionResult> want = RunMlaDecodeOnPool(**host, req);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<PoolAttentionResult> got = RunMlaDecodeOnPool(**cuda, req);
  ASSERT_TRUE(got.ok()) << got.status();

  ASSERT_EQ(got->output.size(), want->output.size());
  ASSERT_EQ(got->lse.size(), want->lse.size());
  float max_ref = 0, max_err = 0;
  for (size_t i = 0; i < want->output.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got->output[i])) << i;
    max_ref = std::max(max_ref, std::fabs(want->output[i]));
    max_err = std::max(max_err, std::fabs(want->output[i] - got->output[i]));
  }
  ASSERT_GT(max_ref, 0.0f);
  EXPECT_LE(max_err, 1e-2f * max_ref);
  for (size_t i = 0; i < want->lse.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got->lse[i])) << i;
    EXPECT_NEAR(got->lse[i], want->lse[i], 1e-3f * (1 + std::fabs(want->lse[i]))) << i;
  }

  // The device path checks ownership as the host path does, and releases the pool's lock.
  absl::StatusOr<PoolAttentionResult> foreign =
      RunMlaDecodeOnPool(**cuda, ScatteredMlaRequest(kLayer, kEpoch + 1, query));
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kFailedPrecondition) << foreign.status();
  const std::vector<BlockId> one = {4};
  EXPECT_TRUE((*cuda)->Free(one, kEpoch).ok());
}

TEST_F(PoolAttentionCudaTest, Bf16PoolMatchesHostPool) {
  ExpectCudaPoolMatchesHostPool(KvDtype::kBf16);
}
TEST_F(PoolAttentionCudaTest, Fp8PoolMatchesHostPool) {
  ExpectCudaPoolMatchesHostPool(KvDtype::kFp8);
}

}  // namespace
}  // namespace kvcm
