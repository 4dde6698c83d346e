#include "server/core/recency_buffer.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvcm {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);

TEST(RecencyBufferTest, TakeReturnsTheAccessesInTheOrderRecordedAndEmptiesTheBuffer) {
  RecencyBuffer buffer;
  EXPECT_EQ(buffer.Record(nullptr, 3, kT0), 1u);
  EXPECT_EQ(buffer.NextStamp(), 2u);  // an exclusive section's access in between
  EXPECT_EQ(buffer.Record(nullptr, 5, kT0 + absl::Seconds(1)), 2u);
  std::vector<RecencyBuffer::Entry> out = {RecencyBuffer::Entry{}};  // cleared first
  buffer.Take(out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].end_page, 3u);
  EXPECT_EQ(out[0].stamp, 1u);
  EXPECT_EQ(out[0].at, kT0);
  EXPECT_EQ(out[1].end_page, 5u);
  EXPECT_EQ(out[1].stamp, 3u);
  buffer.Take(out);
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(buffer.Record(nullptr, 1, kT0), 1u);  // counts from empty again
}

TEST(RecencyBufferTest, ConcurrentRecordsAreKeptInStampOrder) {
  RecencyBuffer buffer;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 1000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&buffer, t] {
      for (int i = 0; i < kPerThread; ++i) {
        if (i % 7 == 0) buffer.NextStamp();
        buffer.Record(nullptr, static_cast<uint32_t>(t), kT0);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<RecencyBuffer::Entry> out;
  buffer.Take(out);
  ASSERT_EQ(out.size(), size_t{kThreads * kPerThread});
  for (size_t i = 1; i < out.size(); ++i) EXPECT_LT(out[i - 1].stamp, out[i].stamp);
}

}  // namespace
}  // namespace kvcm
