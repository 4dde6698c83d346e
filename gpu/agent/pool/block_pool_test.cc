#include "gpu/agent/pool/block_pool.h"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "common/model_catalog.h"
#include "gmock/gmock.h"
#include "gpu/agent/pool/pool_attention.h"
#include "gpu/kernels/mla_decode_cpu.h"
#include "gpu/kernels/mla_math.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ModelSpec DeepSeekV3(KvDtype dtype = KvDtype::kBf16) {
  absl::StatusOr<ModelSpec> spec = FindModel("deepseek-v3", dtype);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

uint64_t Product(const BlockLayout& l) {
  uint64_t p = l.element_bytes;
  for (uint64_t d : l.shape) p *= d;
  return p;
}

TEST(PoolGeometryTest, MlaBf16BlockIsOnePageOfEveryLayer) {
  PoolGeometry g{DeepSeekV3(), 8};
  ASSERT_TRUE(g.Validate().ok());
  // 576 bf16 elements per token per layer, 61 layers, 64 tokens a page.
  EXPECT_EQ(g.bytes_per_block(), 1152u * 61 * 64);
  EXPECT_EQ(g.bytes_per_block(), g.spec.BytesPerPage());
  const BlockLayout l = g.Layout();
  EXPECT_THAT(l.shape, ElementsAre(8, 61, 64, 576));
  EXPECT_EQ(l.element_bytes, 2u);
  EXPECT_EQ(Product(l), g.pool_bytes());
}

TEST(PoolGeometryTest, FlashMlaFp8Is656BytesPerTokenPerLayer) {
  PoolGeometry g{DeepSeekV3(KvDtype::kFp8), 2};
  ASSERT_TRUE(g.Validate().ok());
  EXPECT_EQ(g.bytes_per_block(), 656u * 61 * 64);
  EXPECT_THAT(g.Layout().shape, ElementsAre(2, 61, 64, 656));
  EXPECT_EQ(Product(g.Layout()), g.pool_bytes());
}

TEST(PoolGeometryTest, GqaIsKThenVPerKvHead) {
  PoolGeometry g{SmallGqa(), 3};
  ASSERT_TRUE(g.Validate().ok());
  EXPECT_EQ(g.bytes_per_block(), 2u * 4 * 8 * 2 * 2 * 4);  // K+V, heads, dim, bf16, layers, page
  EXPECT_THAT(g.Layout().shape, ElementsAre(3, 2, 2, 4, 4, 8));
  EXPECT_EQ(Product(g.Layout()), g.pool_bytes());
  absl::StatusOr<ModelSpec> llama = FindModel("llama-3-70b");
  ASSERT_TRUE(llama.ok()) << llama.status();
  PoolGeometry l{*llama, 1};
  EXPECT_THAT(l.Layout().shape, ElementsAre(1, 80, 2, 8, 64, 128));
  EXPECT_EQ(Product(l.Layout()), l.pool_bytes());
}

TEST(PoolGeometryTest, BadGeometryIsInvalidArgumentNamingTheField) {
  PoolGeometry g{SmallGqa(), 0};
  EXPECT_EQ(g.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(g.Validate().message(), HasSubstr("geometry.num_blocks"));
  g.num_blocks = PoolGeometry::kMaxBlocks + 1;
  EXPECT_THAT(g.Validate().message(), HasSubstr("geometry.num_blocks"));
  g.num_blocks = 1;
  g.spec.num_kv_heads = 3;  // does not divide 8 heads
  EXPECT_EQ(g.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(g.Validate().message(), HasSubstr("geometry.spec.num_kv_heads"));
  g.spec = SmallGqa();
  g.spec.num_layers = 0;
  EXPECT_THAT(g.Validate().message(), HasSubstr("geometry.spec.num_layers"));

  absl::StatusOr<PoolGeometry> tiny = PoolGeometry::ForCapacity(SmallGqa(), 100);
  EXPECT_EQ(tiny.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tiny.status().message(), HasSubstr("capacity_bytes"));
  absl::StatusOr<PoolGeometry> fit = PoolGeometry::ForCapacity(SmallGqa(), 3 * 1024 + 1023);
  ASSERT_TRUE(fit.ok());
  EXPECT_EQ(fit->num_blocks, 3u);
}

TEST(BlockPoolTest, ArenaSmallerThanThePoolIsRefused) {
  PoolGeometry g{SmallGqa(), 4};
  absl::StatusOr<std::unique_ptr<DeviceBackend>> host = CreateHostBackend(g.pool_bytes() - 1);
  ASSERT_TRUE(host.ok());
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::Create(g, *std::move(host));
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("arena"));
}

TEST(BlockPoolTest, ExactByteAccounting) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 10);
  const uint64_t per_block = pool->geometry().bytes_per_block();
  BlockPoolStats s = pool->Stats();
  EXPECT_EQ(s.num_blocks, 10u);
  EXPECT_EQ(s.free_blocks, 10u);
  EXPECT_EQ(s.capacity_bytes, 10 * per_block);
  EXPECT_EQ(s.used_bytes, 0u);
  absl::StatusOr<std::vector<BlockId>> a = pool->Allocate(3, 1);
  ASSERT_TRUE(a.ok());
  EXPECT_THAT(*a, ElementsAre(0, 1, 2));
  EXPECT_EQ(pool->Stats().used_bytes, 3 * per_block);
  EXPECT_EQ(pool->Stats().free_blocks, 7u);
  EXPECT_EQ(pool->Allocate(8, 1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->Stats().used_bytes, 3 * per_block) << "a refused Allocate takes nothing";
  ASSERT_TRUE(pool->Allocate(7, 2).ok());
  EXPECT_EQ(pool->Stats().used_bytes, 10 * per_block);
  EXPECT_EQ(pool->Stats().free_blocks, 0u);
  ASSERT_TRUE(pool->Free(std::vector<BlockId>{1}, 1).ok());
  EXPECT_EQ(pool->Stats().used_bytes, 9 * per_block);
  EXPECT_EQ(pool->BlockOffset(3), 3 * per_block);
}

TEST(BlockPoolTest, DoubleFreeForeignEpochAndBadIdsAreRefusedAllOrNothing) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 4);
  absl::StatusOr<std::vector<BlockId>> a = pool->Allocate(2, 7);
  ASSERT_TRUE(a.ok());
  const BlockId x = (*a)[0];
  const BlockId y = (*a)[1];
  EXPECT_EQ(pool->Free(std::vector<BlockId>{x, y}, 8).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(pool->Free(std::vector<BlockId>{x, 4}, 7).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool->Free(std::vector<BlockId>{x, x}, 7).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Free({}, 7).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Free(std::vector<BlockId>{x}, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Stats().free_blocks, 2u) << "refused frees change nothing";
  ASSERT_TRUE(pool->Free(std::vector<BlockId>{x}, 7).ok());
  absl::Status twice = pool->Free(std::vector<BlockId>{x, y}, 7);
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(twice.message(), HasSubstr("double free"));
  EXPECT_EQ(pool->Stats().free_blocks, 3u) << "y must still be allocated";
  EXPECT_TRUE(pool->Free(std::vector<BlockId>{y}, 7).ok());
  EXPECT_EQ(pool->Allocate(0, 7).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Allocate(1, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// Randomised alloc/free against a model: a block is never handed out twice, and every
// block's bytes (tagged with its owner on allocation) survive other blocks' traffic.
TEST(BlockPoolTest, RandomisedNeverHandsOutABlockTwice) {
  constexpr uint64_t kBlocks = 64;
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), kBlocks);
  const uint64_t per_block = pool->geometry().bytes_per_block();
  std::mt19937 rng(1234);
  std::set<BlockId> held;
  for (int step = 0; step < 5000; ++step) {
    if (rng() % 2 == 0) {
      const uint32_t n = 1 + rng() % 8;
      absl::StatusOr<std::vector<BlockId>> got = pool->Allocate(n, 1);
      if (n > kBlocks - held.size()) {
        ASSERT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted);
        continue;
      }
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->size(), n);
      for (BlockId id : *got) {
        ASSERT_LT(id, kBlocks);
        ASSERT_TRUE(held.insert(id).second) << "block " << id << " handed out twice";
        std::vector<std::byte> tag(per_block, std::byte(id));
        ASSERT_TRUE(pool->backend().CopyIn(pool->BlockOffset(id), tag).ok());
      }
    } else if (!held.empty()) {
      std::vector<BlockId> give;
      for (BlockId id : held) {
        if (rng() % 3 == 0) give.push_back(id);
      }
      if (give.empty()) give.push_back(*held.begin());
      for (BlockId id : give) {
        std::vector<std::byte> back(per_block);
        ASSERT_TRUE(pool->backend().CopyOut(pool->BlockOffset(id), back).ok());
        ASSERT_EQ(back.front(), std::byte(id));
        ASSERT_EQ(back.back(), std::byte(id));
      }
      ASSERT_TRUE(pool->Free(give, 1).ok());
      for (BlockId id : give) held.erase(id);
    }
    ASSERT_EQ(pool->Stats().free_blocks, kBlocks - held.size());
    ASSERT_EQ(pool->Stats().used_bytes, held.size() * per_block);
  }
}

std::vector<std::byte> Pattern(size_t n, uint8_t seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 31 + seed) & 0xFF);
  return v;
}

std::vector<std::byte> ReadWhole(const BlockPool& pool, BlockId id, uint64_t epoch) {
  std::vector<std::byte> out(pool.geometry().bytes_per_block());
  EXPECT_TRUE(pool.ReadBlock(id, epoch, 0, out).ok());
  return out;
}

TEST(BlockPoolTest, WriteBlocksIsAllOrNothingAndReadBlockChecksOwnership) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 4);
  const uint64_t bpb = pool->geometry().bytes_per_block();
  absl::StatusOr<std::vector<BlockId>> ids = pool->Allocate(2, 7);
  ASSERT_TRUE(ids.ok());
  const std::vector<BlockId> order = {(*ids)[1], (*ids)[0]};
  const std::vector<std::byte> bytes = Pattern(2 * bpb, 3);
  ASSERT_TRUE(pool->WriteBlocks(order, 7, bytes).ok());
  EXPECT_TRUE(std::memcmp(ReadWhole(*pool, order[0], 7).data(), bytes.data(), bpb) == 0);
  EXPECT_TRUE(std::memcmp(ReadWhole(*pool, order[1], 7).data(), bytes.data() + bpb, bpb) == 0);

  const std::vector<std::byte> other = Pattern(2 * bpb, 99);
  EXPECT_EQ(pool->WriteBlocks(order, 7, std::span(other).first(2 * bpb - 1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->WriteBlocks(order, 8, other).code(), absl::StatusCode::kFailedPrecondition);
  const BlockId free_id = (*ids)[0] == 3 || (*ids)[1] == 3 ? 2 : 3;  // never allocated
  const std::vector<BlockId> with_free = {order[0], free_id};
  absl::Status st = pool->WriteBlocks(with_free, 7, other);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("block_ids"));
  EXPECT_TRUE(std::memcmp(ReadWhole(*pool, order[0], 7).data(), bytes.data(), bpb) == 0)
      << "a refused write leaves the first block as it was";

  std::vector<std::byte> one(1);
  EXPECT_EQ(pool->ReadBlock(order[0], 8, 0, one).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->ReadBlock(free_id, 7, 0, one).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->ReadBlock(4, 7, 0, one).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->ReadBlock(order[0], 7, bpb, one).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(pool->ReadBlock(order[0], 7, bpb - 1, one).ok());
  EXPECT_EQ(one[0], bytes[bpb - 1]);
}

// Every write path counts the bytes it writes against the allocation (a commit from the
// manager requires the whole block), and only the allocator's commit is taken.
TEST(BlockPoolTest, EveryWritePathCountsItsBytesForTheCommitCheck) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 8);
  const uint64_t bpb = pool->geometry().bytes_per_block();
  const NamespaceId ns{"acme", "m"};
  const CommitChecks checks{.committer = "alice", .block_bytes = bpb};
  absl::StatusOr<std::vector<BlockId>> ids = pool->Allocate(4, 7, &ns, nullptr, false, "alice");
  ASSERT_TRUE(ids.ok());
  const std::vector<std::byte> bytes = Pattern(2 * bpb, 5);
  // WriteBlocks: whole blocks.
  ASSERT_TRUE(pool->WriteBlocks({&(*ids)[0], 1}, 7, std::span(bytes).first(bpb)).ok());
  // WriteRange: two halves of block 1, as a WriteBlocks stream's chunks.
  ASSERT_TRUE(
      pool->WriteRange({&(*ids)[1], 1}, {}, 7, 0, std::span(bytes).first(bpb / 2), "c").ok());
  // WithCheckedBlocks (the local path's STORE): the bytes its callback says it wrote.
  const uint64_t whole[] = {bpb};
  ASSERT_TRUE(pool->WithCheckedBlocks(
                      {&(*ids)[2], 1}, 7, true, "b", {}, nullptr,
                      [](DeviceBackend&) { return absl::OkStatus(); }, whole)
                  .ok());
  // WithWritableBlock (a pull's receive): what its callback returns.
  ASSERT_TRUE(pool->WithWritableBlock((*ids)[3], 7, "d",
                                      [&](std::byte*) -> absl::StatusOr<uint64_t> { return bpb; })
                  .ok());

  auto commit = [&](BlockId id, uint64_t page, const CommitChecks& c) {
    const CommitEntry e{.block = id, .page = PageHash{.lo = page, .hi = 1}};
    return pool->Commit(ns, 7, {&e, 1}, "block_ids", 0, c).status();
  };
  EXPECT_EQ(commit((*ids)[1], 2, checks).code(), absl::StatusCode::kFailedPrecondition)
      << "half of block 1 is written";
  ASSERT_TRUE(
      pool->WriteRange({&(*ids)[1], 1}, {}, 7, bpb / 2, std::span(bytes).first(bpb - bpb / 2), "c")
          .ok());
  EXPECT_EQ(commit((*ids)[0], 1, {.committer = "bob", .block_bytes = bpb}).code(),
            absl::StatusCode::kPermissionDenied);
  for (uint64_t i = 0; i < 4; ++i) EXPECT_TRUE(commit((*ids)[i], i + 1, checks).ok()) << i;
}

// With digests on, a committed block whose bytes change is refused at every read path.
TEST(BlockPoolTest, DigestsCatchBytesChangedSinceTheCommitAtEveryRead) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 4);
  pool->EnableDigests(1, 2);
  const uint64_t bpb = pool->geometry().bytes_per_block();
  const NamespaceId ns{"acme", "m"};
  absl::StatusOr<std::vector<BlockId>> ids = pool->Allocate(2, 7, &ns);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(pool->WriteBlocks(*ids, 7, Pattern(2 * bpb, 9)).ok());
  const PageHash pages[] = {{.lo = 1, .hi = 1}, {.lo = 2, .hi = 1}};
  const CommitEntry entries[] = {{.block = (*ids)[0], .page = pages[0]},
                                 {.block = (*ids)[1], .page = pages[1], .parent = pages[0]}};
  ASSERT_TRUE(pool->Commit(ns, 7, entries, "block_ids").ok());
  std::vector<std::byte> out(bpb);
  const PageCheck check{.ns = &ns, .pages = pages};
  ASSERT_TRUE(pool->ReadRange(*ids, {}, 7, 0, out, "r", &check).ok()) << "unchanged bytes read";
  ASSERT_TRUE(pool->ReadCommittedBlock((*ids)[1], ns, pages[1], out, "p").ok());

  // Something that is not a write of the pool's (a stray device write, a bit flip) changes
  // one byte of block 1.
  pool->backend().base()[pool->BlockOffset((*ids)[1]) + bpb / 3] ^= std::byte{1};
  EXPECT_EQ(pool->ReadRange(*ids, {}, 7, bpb, out, "r", &check).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(pool->ReadCommittedBlock((*ids)[1], ns, pages[1], out, "p").code(),
            absl::StatusCode::kDataLoss);
  const absl::Status local = pool->WithCheckedBlocks(
      *ids, 7, false, "block_ids", {}, &check, [](DeviceBackend&) { return absl::OkStatus(); });
  EXPECT_EQ(local.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(local.message(), HasSubstr("block_ids: block 1's bytes changed since its commit"));
  EXPECT_EQ(pool->Stats().digest_mismatches, 3u);
  // Block 0 still reads.
  EXPECT_TRUE(pool->ReadRange(*ids, {}, 7, 0, std::span(out).first(bpb), "r", &check).ok());
}

// Host memory that claims to be device memory, as a CUDA backend would.
class FakeDeviceBackend final : public DeviceBackend {
 public:
  explicit FakeDeviceBackend(uint64_t bytes) : mem_(bytes) {}
  std::string name() const override { return "cuda:9"; }
  bool is_device() const override { return true; }
  std::byte* base() const override { return const_cast<std::byte*>(mem_.data()); }
  uint64_t arena_bytes() const override { return mem_.size(); }
  absl::Status CopyIn(uint64_t offset, std::span<const std::byte> src) override {
    if (absl::Status s = CheckRange(offset, src.size()); !s.ok()) return s;
    std::memcpy(mem_.data() + offset, src.data(), src.size());
    return absl::OkStatus();
  }
  absl::Status CopyOut(uint64_t offset, std::span<std::byte> dst) const override {
    if (absl::Status s = CheckRange(offset, dst.size()); !s.ok()) return s;
    std::memcpy(dst.data(), mem_.data() + offset, dst.size());
    return absl::OkStatus();
  }

 private:
  std::vector<std::byte> mem_;
};

// Every direction of CopyBlocksTo: host -> host, device -> host (demotion), host ->
// device, device -> device (staged); bytes land in the listed target blocks, in order.
TEST(BlockPoolTest, CopyBlocksToCopiesWholeBlocksInEveryDirection) {
  const PoolGeometry g{SmallGqa(), 4};
  auto make = [&](bool device) {
    std::unique_ptr<DeviceBackend> backend;
    if (device) {
      backend = std::make_unique<FakeDeviceBackend>(g.pool_bytes());
    } else {
      backend = *CreateHostBackend(g.pool_bytes());
    }
    return *BlockPool::Create(g, std::move(backend));
  };
  const uint64_t bpb = g.bytes_per_block();
  for (const auto& [src_device, dst_device] :
       {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << "src device " << src_device << ", dst device " << dst_device);
    std::unique_ptr<BlockPool> src = make(src_device);
    std::unique_ptr<BlockPool> dst = make(dst_device);
    const std::vector<BlockId> from = *src->Allocate(2, 7);
    const std::vector<BlockId> to = *dst->Allocate(2, 7);
    const std::vector<std::byte> bytes = Pattern(2 * bpb, 21);
    ASSERT_TRUE(src->WriteBlocks(from, 7, bytes).ok());
    const std::vector<BlockId> reversed = {to[1], to[0]};
    ASSERT_TRUE(src->CopyBlocksTo(from, *dst, reversed, 7).ok());
    EXPECT_TRUE(std::memcmp(ReadWhole(*dst, to[1], 7).data(), bytes.data(), bpb) == 0);
    EXPECT_TRUE(std::memcmp(ReadWhole(*dst, to[0], 7).data(), bytes.data() + bpb, bpb) == 0);
  }
}

TEST(BlockPoolTest, CopyBlocksToChecksEverythingFirst) {
  std::unique_ptr<BlockPool> src = MakeHostPool(SmallGqa(), 4);
  std::unique_ptr<BlockPool> dst = MakeHostPool(SmallGqa(), 4);
  const uint64_t bpb = src->geometry().bytes_per_block();
  const std::vector<BlockId> from = *src->Allocate(2, 7);
  const std::vector<BlockId> to = *dst->Allocate(2, 7);
  const std::vector<BlockId> foreign = *dst->Allocate(1, 8);
  ASSERT_TRUE(src->WriteBlocks(from, 7, Pattern(2 * bpb, 1)).ok());
  ASSERT_TRUE(dst->WriteBlocks(to, 7, Pattern(2 * bpb, 2)).ok());

  EXPECT_EQ(src->CopyBlocksTo(from, *src, from, 7).code(), absl::StatusCode::kInvalidArgument);
  absl::Status s = src->CopyBlocksTo(from, *dst, {to.data(), 1}, 7);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("target_block_ids"));
  const std::vector<BlockId> mixed = {to[0], foreign[0]};
  s = src->CopyBlocksTo(from, *dst, mixed, 7);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("target_block_ids"));
  s = src->CopyBlocksTo(from, *dst, to, 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("source_block_ids"));
  std::unique_ptr<BlockPool> other = MakeHostPool(DeepSeekV3(), 1);
  const std::vector<BlockId> big = *other->Allocate(1, 7);
  EXPECT_EQ(src->CopyBlocksTo({from.data(), 1}, *other, big, 7).code(),
            absl::StatusCode::kInvalidArgument);
  // Nothing was copied by the refused calls.
  EXPECT_TRUE(std::memcmp(ReadWhole(*dst, to[0], 7).data(), Pattern(2 * bpb, 2).data(), bpb) == 0);
}

TEST(PoolAttentionTest, RefusesNonMlaPools) {
  std::unique_ptr<BlockPool> gqa = MakeHostPool(SmallGqa(), 2);
  PoolAttentionRequest req;
  absl::StatusOr<PoolAttentionResult> r = RunMlaDecodeOnPool(*gqa, req);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("pool"));
}

// The host path against the CPU kernel run directly on the attended layer alone (a compact
// cache, block stride page x token bytes): bit-identical, so the pool path's layer offset,
// block stride and table are right. Every other layer is NaN, so a wrong offset shows.
void ExpectHostPoolMatchesLayerAlone(KvDtype dtype) {
  constexpr uint32_t kLayer = 3;
  constexpr uint64_t kEpoch = 5;
  const PoolGeometry g{DeepSeekV3(dtype), kMlaTestPoolBlocks};
  ASSERT_EQ(g.spec.page_size_tokens, 64u) << "ScatteredMlaRequest assumes 64-token pages";
  const std::vector<std::byte> bytes = MakeMlaPoolBytes(g, kLayer, 11);
  absl::StatusOr<std::unique_ptr<DeviceBackend>> host = CreateHostBackend(g.pool_bytes());
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<std::unique_ptr<BlockPool>> pool =
      MakeFilledPool(g, *std::move(host), kEpoch, bytes);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const std::vector<uint16_t> query =
      RandomBf16(kScatteredBatch * kScatteredHeads * gpu::kMlaHeadDim, 12);
  const PoolAttentionRequest req = ScatteredMlaRequest(kLayer, kEpoch, query);
  absl::StatusOr<PoolAttentionResult> got = RunMlaDecodeOnPool(**pool, req);
  ASSERT_TRUE(got.ok()) << got.status();

  const std::vector<std::byte> layer = ExtractLayer(g, kLayer, bytes);
  const std::vector<int32_t> table = {5, 2, 7, 1, 6, 1, 2, 2, 2};  // padded with the row's first
  const std::vector<int32_t> lens(req.seq_lens.begin(), req.seq_lens.end());
  std::vector<uint16_t> out(kScatteredBatch * kScatteredHeads * gpu::kMlaLatentDim);
  std::vector<float> lse(kScatteredBatch * kScatteredHeads);
  gpu::MlaDecodeParams p;
  p.kv_cache = layer.data();
  p.kv_block_stride_bytes =
      static_cast<int64_t>(g.spec.page_size_tokens * g.spec.BytesPerTokenPerLayer());
  p.block_table = table.data();
  p.block_table_stride = 3;
  p.seq_lens = lens.data();
  p.q = query.data();
  p.q_head_stride = gpu::kMlaHeadDim;
  p.q_batch_stride = int64_t{kScatteredHeads} * gpu::kMlaHeadDim;
  p.out = out.data();
  p.out_head_stride = gpu::kMlaLatentDim;
  p.out_batch_stride = int64_t{kScatteredHeads} * gpu::kMlaLatentDim;
  p.lse = lse.data();
  p.batch = kScatteredBatch;
  p.num_heads = kScatteredHeads;
  p.num_blocks = kMlaTestPoolBlocks;
  p.page_size = 64;
  p.max_blocks_per_seq = 3;
  p.dtype = dtype == KvDtype::kFp8 ? gpu::LatentDtype::kFp8E4m3 : gpu::LatentDtype::kBf16;
  p.softmax_scale = req.softmax_scale;
  ASSERT_TRUE(gpu::MlaDecodeCpu(p).ok());

  ASSERT_EQ(got->output.size(), out.size());
  ASSERT_EQ(got->lse.size(), lse.size());
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got->output[i])) << i;
    ASSERT_EQ(got->output[i], gpu::Bf16ToFloat(out[i])) << i;
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got->lse[i])) << i;
    ASSERT_EQ(got->lse[i], lse[i]) << i;
  }
}

TEST(PoolAttentionTest, HostPoolBf16MatchesTheKernelOnTheLayerAlone) {
  ExpectHostPoolMatchesLayerAlone(KvDtype::kBf16);
}
TEST(PoolAttentionTest, HostPoolFp8MatchesTheKernelOnTheLayerAlone) {
  ExpectHostPoolMatchesLayerAlone(KvDtype::kFp8);
}

// A device pool gets the same request and ownership checks as a host pool, before any
// device code runs; past them, host memory posing as a device arena is refused clearly
// (the CUDA path itself is pool_attention_cuda_test.cc, label gpu).
TEST(PoolAttentionTest, DevicePoolSharesTheChecksAndRefusesAFakeArena) {
  constexpr uint32_t kLayer = 1;
  constexpr uint64_t kEpoch = 5;
  const PoolGeometry g{DeepSeekV3(), kMlaTestPoolBlocks};
  const std::vector<std::byte> bytes = MakeMlaPoolBytes(g, kLayer, 11);
  absl::StatusOr<std::unique_ptr<BlockPool>> pool =
      MakeFilledPool(g, std::make_unique<FakeDeviceBackend>(g.pool_bytes()), kEpoch, bytes);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const std::vector<uint16_t> query =
      RandomBf16(kScatteredBatch * kScatteredHeads * gpu::kMlaHeadDim, 12);

  PoolAttentionRequest bad = ScatteredMlaRequest(kLayer, kEpoch, query);
  bad.seq_lens[1] = 2 * 64 + 1;  // more than its two blocks hold
  absl::StatusOr<PoolAttentionResult> r = RunMlaDecodeOnPool(**pool, bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("seq_lens[1]"));

  r = RunMlaDecodeOnPool(**pool, ScatteredMlaRequest(kLayer, kEpoch + 1, query));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("block_table"));

  r = RunMlaDecodeOnPool(**pool, ScatteredMlaRequest(kLayer, kEpoch, query));
#ifdef KVCM_CUDA_ENABLED
  // The CUDA path asks the runtime what the arena is: with no usable device that fails
  // (UNAVAILABLE); with one, host memory is not device memory (FAILED_PRECONDITION).
  EXPECT_THAT(r.status().code(), ::testing::AnyOf(absl::StatusCode::kUnavailable,
                                                  absl::StatusCode::kFailedPrecondition))
      << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr(r.status().code() == absl::StatusCode::kUnavailable
                                                  ? "cudaPointerGetAttributes"
                                                  : "not device memory"));
#else
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("cuda:9"));
  EXPECT_THAT(r.status().message(), HasSubstr("no CUDA"));
#endif
}

TEST(BlockPoolTest, WithOwnedArenaHandsAnyArenaWithTheOwnershipChecks) {
  PoolGeometry g{SmallGqa(), 2};
  absl::StatusOr<std::unique_ptr<BlockPool>> device =
      BlockPool::Create(g, std::make_unique<FakeDeviceBackend>(g.pool_bytes()));
  ASSERT_TRUE(device.ok());
  absl::StatusOr<std::vector<BlockId>> ids = (*device)->Allocate(1, 3);
  ASSERT_TRUE(ids.ok());
  const std::byte* seen = nullptr;
  auto record = [&](const std::byte* arena) {
    seen = arena;
    return absl::OkStatus();
  };
  EXPECT_TRUE((*device)->WithOwnedArena(*ids, 3, "ids", record).ok());
  EXPECT_EQ(seen, (*device)->backend().base());
  seen = nullptr;
  absl::Status foreign = (*device)->WithOwnedArena(*ids, 4, "ids", record);
  EXPECT_EQ(foreign.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(foreign.message(), HasSubstr("ids"));
  EXPECT_EQ(seen, nullptr) << "fn must not run for blocks the caller does not own";
  EXPECT_EQ((*device)
                ->WithOwnedArena(*ids, 3, "ids",
                                 [](const std::byte*) { return absl::DataLossError("from fn"); })
                .code(),
            absl::StatusCode::kDataLoss)
      << "fn's status is returned";

  // The host-only variant keeps its contract: a device arena is never handed out.
  EXPECT_EQ((*device)->WithOwnedHostArena(*ids, 3, "ids", record).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(seen, nullptr);
  std::unique_ptr<BlockPool> host = MakeHostPool(SmallGqa(), 2);
  ids = host->Allocate(1, 3);
  ASSERT_TRUE(ids.ok());
  EXPECT_TRUE(host->WithOwnedHostArena(*ids, 3, "ids", record).ok());
  EXPECT_EQ(seen, host->backend().base());
}

TEST(BlockPoolTest, WithCommittedBlockAndWithWritableBlockHandOutOneCheckedBlock) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 4);
  const NamespaceId ns{"acme", "small"};
  const PageHash page{1, 2};
  absl::StatusOr<std::vector<BlockId>> ids = pool->Allocate(2, 3, &ns);
  ASSERT_TRUE(ids.ok());
  const BlockId writable = (*ids)[0];
  const BlockId committed = (*ids)[1];
  ASSERT_TRUE(
      pool->Commit(ns, 3, std::vector<CommitEntry>{{.block = committed, .page = page}}, "block_ids")
          .ok());
  const std::byte* seen = nullptr;
  auto record = [&](const std::byte* block) {
    seen = block;
    return absl::OkStatus();
  };
  // A committed block of that page: fn gets the block's start.
  EXPECT_TRUE(pool->WithCommittedBlock(committed, ns, page, "b", record).ok());
  EXPECT_EQ(seen, pool->backend().base() + pool->BlockOffset(committed));
  // Another page, another namespace, a merely allocated block, an id past the pool: not run.
  seen = nullptr;
  EXPECT_EQ(pool->WithCommittedBlock(committed, ns, PageHash{9, 9}, "b", record).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->WithCommittedBlock(committed, {"other", "small"}, page, "b", record).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(pool->WithCommittedBlock(writable, ns, page, "b[0]", record).message(),
              HasSubstr("b[0]"));
  EXPECT_EQ(pool->WithCommittedBlock(99, ns, page, "b", record).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(seen, nullptr);

  // Writable: allocated to the owner and not committed.
  auto write = [&](std::byte* block) -> absl::StatusOr<uint64_t> {
    seen = block;
    return 0;
  };
  EXPECT_TRUE(pool->WithWritableBlock(writable, 3, "d", write).ok());
  EXPECT_EQ(seen, pool->backend().base() + pool->BlockOffset(writable));
  seen = nullptr;
  EXPECT_EQ(pool->WithWritableBlock(committed, 3, "d", write).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->WithWritableBlock(writable, 4, "d", write).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(seen, nullptr);
}

TEST(DeviceBackendTest, HostBackendChecksRanges) {
  absl::StatusOr<std::unique_ptr<DeviceBackend>> host = CreateHostBackend(16);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ((*host)->name(), "host");
  EXPECT_FALSE((*host)->is_device());
  std::vector<std::byte> buf(8);
  EXPECT_TRUE((*host)->CopyIn(8, buf).ok());
  EXPECT_EQ((*host)->CopyIn(9, buf).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*host)->CopyOut(~uint64_t{0}, buf).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(CreateHostBackend(0).status().code(), absl::StatusCode::kInvalidArgument);
}

bool g_released = false;

TEST(DeviceBackendTest, AdoptedHostArenaIsReleasedWithTheBackend) {
  auto* arena = new std::byte[32];
  g_released = false;
  {
    std::unique_ptr<DeviceBackend> b = AdoptHostArena(arena, 32, "host-test", [](std::byte* p) {
      g_released = true;
      delete[] p;
    });
    EXPECT_EQ(b->name(), "host-test");
    EXPECT_FALSE(b->is_device());
    EXPECT_EQ(b->base(), arena);
    const std::vector<std::byte> in = Pattern(32, 4);
    ASSERT_TRUE(b->CopyIn(0, in).ok());
    std::vector<std::byte> out(32);
    ASSERT_TRUE(b->CopyOut(0, out).ok());
    EXPECT_EQ(out, in);
    EXPECT_FALSE(g_released);
  }
  EXPECT_TRUE(g_released);
}

#ifdef KVCM_CUDA_ENABLED
// Page-locked host memory needs a CUDA driver: with one, a working host arena; without one
// (every CI machine), a clear error the agent falls back from.
TEST(DeviceBackendTest, PinnedHostBackendWorksOrSaysWhy) {
  absl::StatusOr<std::unique_ptr<DeviceBackend>> pinned = CreatePinnedHostBackend(64);
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok() || *count == 0) {
    ASSERT_FALSE(pinned.ok());
    EXPECT_THAT(pinned.status().message(), HasSubstr("cudaHostAlloc"));
    return;
  }
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ((*pinned)->name(), "host-pinned");
  EXPECT_FALSE((*pinned)->is_device());
  const std::vector<std::byte> in = Pattern(64, 9);
  ASSERT_TRUE((*pinned)->CopyIn(0, in).ok());
  EXPECT_EQ(std::memcmp((*pinned)->base(), in.data(), 64), 0);
  EXPECT_EQ(CreatePinnedHostBackend(0).status().code(), absl::StatusCode::kInvalidArgument);
}
#endif

// Without a GPU (every CI machine), CreateBackend must fall back to the host and say why.
TEST(DeviceBackendTest, CreateBackendFallsBackToHostWithoutADevice) {
  absl::StatusOr<BackendChoice> forced = CreateBackend({.arena_bytes = 64, .allow_device = false});
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_EQ(forced->backend->name(), "host");
  EXPECT_THAT(forced->reason, HasSubstr("host"));
  absl::StatusOr<BackendChoice> any = CreateBackend({.arena_bytes = 64});
  ASSERT_TRUE(any.ok()) << any.status();
#ifdef KVCM_CUDA_ENABLED
  absl::StatusOr<int> count = CudaDeviceCount();
  if (count.ok() && *count > 0) {
    EXPECT_TRUE(any->backend->is_device());
    GTEST_SKIP() << "a CUDA device is present; the fallback is not exercised";
  }
#endif
  EXPECT_EQ(any->backend->name(), "host");
  EXPECT_THAT(any->reason, HasSubstr("host DRAM"));
}

}  // namespace
}  // namespace kvcm
