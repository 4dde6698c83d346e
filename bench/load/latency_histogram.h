// LatencyHistogram: a log-bucketed latency histogram (HDR-style) for kvcm-load.
//
// Values are nanoseconds. Buckets are powers of two split into kSubBuckets linear
// sub-buckets, so a percentile is exact to within 1/kSubBuckets (about 3 %) of its value;
// values of 2^40 ns (18 minutes) and more land in the last bucket.
//
// Not thread-safe: one writer at a time (kvcm-load keeps one per worker and merges them).
#ifndef KVCM_BENCH_LOAD_LATENCY_HISTOGRAM_H_
#define KVCM_BENCH_LOAD_LATENCY_HISTOGRAM_H_

#include <array>
#include <cstdint>

namespace kvcm::load {

class LatencyHistogram {
 public:
  static constexpr int kSubBucketBits = 5;
  static constexpr int kSubBuckets = 1 << kSubBucketBits;
  static constexpr int kMaxExponent = 40;
  static constexpr int kNumBuckets = (kMaxExponent - kSubBucketBits + 1) * kSubBuckets;

  void Record(int64_t value_ns);
  void Merge(const LatencyHistogram& other);
  void Clear();

  uint64_t count() const { return count_; }
  int64_t max_ns() const { return max_ns_; }
  double mean_ns() const { return count_ == 0 ? 0 : static_cast<double>(sum_ns_) / count_; }
  // Smallest recorded value v such that a fraction q (0..1) of the values is <= v, as the
  // upper edge of its bucket (never above max_ns()); 0 when empty.
  int64_t Percentile(double q) const;

 private:
  static int BucketOf(uint64_t value_ns);
  static uint64_t UpperEdge(int bucket);

  std::array<uint64_t, kNumBuckets> counts_{};
  uint64_t count_ = 0;
  uint64_t sum_ns_ = 0;
  int64_t max_ns_ = 0;
};

}  // namespace kvcm::load

#endif  // KVCM_BENCH_LOAD_LATENCY_HISTOGRAM_H_
