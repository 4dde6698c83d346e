#include "bench/load/latency_histogram.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace kvcm::load {

// Values below kSubBuckets get one bucket each; above, the top kSubBucketBits + 1 bits of a
// value pick its bucket (the leading one fixes the power of two, the rest the sub-bucket).
int LatencyHistogram::BucketOf(uint64_t v) {
  if (v < kSubBuckets) {
    return static_cast<int>(v);
  }
  const int exponent = std::bit_width(v) - 1 - kSubBucketBits;  // >= 0
  const int sub = static_cast<int>((v >> exponent) - kSubBuckets);
  const int bucket = (exponent + 1) * kSubBuckets + sub;
  return std::min(bucket, kNumBuckets - 1);
}

uint64_t LatencyHistogram::UpperEdge(int bucket) {
  if (bucket < kSubBuckets) {
    return static_cast<uint64_t>(bucket);
  }
  const int exponent = bucket / kSubBuckets - 1;
  const uint64_t sub = static_cast<uint64_t>(bucket % kSubBuckets) + kSubBuckets;
  return ((sub + 1) << exponent) - 1;
}

void LatencyHistogram::Record(int64_t value_ns) {
  const uint64_t v = value_ns < 0 ? 0 : static_cast<uint64_t>(value_ns);
  ++counts_[BucketOf(v)];
  ++count_;
  sum_ns_ += v;
  max_ns_ = std::max<int64_t>(max_ns_, static_cast<int64_t>(v));
}

void LatencyHistogram::Merge(const LatencyHistogram& other) {
  for (int i = 0; i < kNumBuckets; ++i) {
    counts_[i] += other.counts_[i];
  }
  count_ += other.count_;
  sum_ns_ += other.sum_ns_;
  max_ns_ = std::max(max_ns_, other.max_ns_);
}

void LatencyHistogram::Clear() { *this = LatencyHistogram(); }

int64_t LatencyHistogram::Percentile(double q) const {
  if (count_ == 0) {
    return 0;
  }
  const uint64_t rank =
      std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(q * static_cast<double>(count_))));
  uint64_t seen = 0;
  for (int i = 0; i < kNumBuckets; ++i) {
    seen += counts_[i];
    if (seen >= rank) {
      // The last bucket holds everything from 2^kMaxExponent up: its edge says nothing.
      if (i == kNumBuckets - 1) {
        return max_ns_;
      }
      return std::min<int64_t>(static_cast<int64_t>(UpperEdge(i)), max_ns_);
    }
  }
  return max_ns_;
}

}  // namespace kvcm::load
