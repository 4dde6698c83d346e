#include "common/secure_random.h"

#include <bit>
#include <cstdint>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

TEST(SecureRandomTest, ValuesAreDistinctAndUseAllBits) {
  SecureRandom random;
  absl::flat_hash_set<uint64_t> seen;
  uint64_t ones_per_bit[64] = {};
  constexpr int kValues = 4096;  // several refills of the buffer
  for (int i = 0; i < kValues; ++i) {
    const uint64_t v = random.Next64();
    EXPECT_TRUE(seen.insert(v).second) << "repeated value " << v;
    for (int b = 0; b < 64; ++b) ones_per_bit[b] += (v >> b) & 1;
  }
  // Every bit is set in about half of the values (a counter would leave the high bits 0).
  for (int b = 0; b < 64; ++b) {
    EXPECT_GT(ones_per_bit[b], kValues / 4) << "bit " << b;
    EXPECT_LT(ones_per_bit[b], 3 * kValues / 4) << "bit " << b;
  }
}

TEST(SecureRandomTest, TwoGeneratorsDoNotAgree) {
  SecureRandom a, b;
  EXPECT_NE(a.Next64(), b.Next64());
}

}  // namespace
}  // namespace kvcm
