// LatencyHistogram's percentiles and RpcMix's parsing and draws.
#include "bench/load/load_stats.h"

#include <random>

#include "bench/load/latency_histogram.h"
#include "gtest/gtest.h"

namespace kvcm::load {
namespace {

TEST(LatencyHistogram, PercentilesWithinABucketOfTheTruth) {
  LatencyHistogram h;
  for (int64_t v = 1; v <= 100'000; ++v) {
    h.Record(v * 1000);  // 1 µs .. 100 ms
  }
  EXPECT_EQ(h.count(), 100'000u);
  EXPECT_EQ(h.max_ns(), 100'000'000);
  for (double q : {0.5, 0.9, 0.99, 0.999}) {
    const double truth = q * 100'000'000;
    EXPECT_GE(h.Percentile(q), truth) << q;
    EXPECT_LE(h.Percentile(q), truth * (1 + 1.0 / LatencyHistogram::kSubBuckets)) << q;
  }
  EXPECT_EQ(h.Percentile(1.0), h.max_ns());
  EXPECT_NEAR(h.mean_ns(), 50'000'500, 1);
}

TEST(LatencyHistogram, SmallValuesExactAndHugeValuesClamped) {
  LatencyHistogram h;
  h.Record(-5);
  h.Record(7);
  EXPECT_EQ(h.Percentile(0.5), 0);
  EXPECT_EQ(h.Percentile(1.0), 7);
  h.Record(int64_t{1} << 50);
  EXPECT_EQ(h.Percentile(1.0), int64_t{1} << 50);
}

TEST(LatencyHistogram, MergeAddsCounts) {
  LatencyHistogram a, b;
  a.Record(100);
  b.Record(200);
  b.Record(300);
  a.Merge(b);
  EXPECT_EQ(a.count(), 3u);
  EXPECT_EQ(a.max_ns(), 300);
  EXPECT_GE(a.Percentile(0.34), 200);  // the upper edge of 200's bucket
  EXPECT_LT(a.Percentile(0.34), 300);
  a.Clear();
  EXPECT_EQ(a.count(), 0u);
  EXPECT_EQ(a.Percentile(0.5), 0);
}

TEST(RpcMix, ParsesAndDrawsInProportion) {
  absl::StatusOr<RpcMix> mix = RpcMix::Parse("match:70,insert:20,route:10");
  ASSERT_TRUE(mix.ok()) << mix.status();
  EXPECT_EQ(mix->weight(RpcKind::kRelease), 0u);
  EXPECT_EQ(mix->ToString(), "match:70,insert:20,route:10");
  std::mt19937_64 rng(1);
  int counts[kNumRpcKinds] = {};
  for (int i = 0; i < 100'000; ++i) {
    ++counts[static_cast<int>(mix->Draw(rng))];
  }
  EXPECT_NEAR(counts[0], 70'000, 1'000);
  EXPECT_NEAR(counts[1], 20'000, 1'000);
  EXPECT_EQ(counts[2], 0);
  EXPECT_NEAR(counts[3], 10'000, 1'000);
}

TEST(RpcMix, RejectsBadSpecs) {
  EXPECT_FALSE(RpcMix::Parse("").ok());
  EXPECT_FALSE(RpcMix::Parse("match:0").ok());
  EXPECT_FALSE(RpcMix::Parse("match").ok());
  EXPECT_FALSE(RpcMix::Parse("evict:5").ok());
  EXPECT_FALSE(RpcMix::Parse("match:x").ok());
}

}  // namespace
}  // namespace kvcm::load
