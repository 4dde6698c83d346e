// StreamLimiter: how many BlockAgent streams (WriteBlocks + ReadBlocks) each principal has
// open, against AgentOptions::max_streams_per_principal. A stream takes a slot when it
// starts and gives it back when its reactor is done (finished, failed or cancelled), so a
// principal that hit the cap may open streams again as soon as one of its streams ends.
//
// Thread-safe.
#ifndef KVCM_GPU_AGENT_SERVER_STREAM_LIMITER_H_
#define KVCM_GPU_AGENT_SERVER_STREAM_LIMITER_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvcm {

class StreamLimiter {
 public:
  // One open stream of one principal; released on destruction. Move-only.
  class Slot {
   public:
    Slot() = default;
    Slot(Slot&& other) noexcept { *this = std::move(other); }
    Slot& operator=(Slot&& other) noexcept;
    ~Slot() { Release(); }
    // Gives the slot back now (idempotent).
    void Release();

   private:
    friend class StreamLimiter;
    Slot(StreamLimiter* limiter, std::string principal)
        : limiter_(limiter), principal_(std::move(principal)) {}
    StreamLimiter* limiter_ = nullptr;
    std::string principal_;
  };

  // REQUIRES: max_streams_per_principal >= 1.
  explicit StreamLimiter(uint32_t max_streams_per_principal)
      : max_streams_(max_streams_per_principal) {}
  StreamLimiter(const StreamLimiter&) = delete;
  StreamLimiter& operator=(const StreamLimiter&) = delete;

  // A slot for one more stream of `principal`; RESOURCE_EXHAUSTED naming
  // max_streams_per_principal when it already has that many open. The limiter must
  // outlive the slot.
  absl::StatusOr<Slot> Acquire(const std::string& principal) ABSL_LOCKS_EXCLUDED(mu_);

  // Streams `principal` has open now.
  uint32_t open(const std::string& principal) const ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t max_streams_per_principal() const { return max_streams_; }

 private:
  void Release(const std::string& principal) ABSL_LOCKS_EXCLUDED(mu_);

  const uint32_t max_streams_;
  mutable absl::Mutex mu_;
  // Principals with at least one open stream (an entry goes when its count reaches 0).
  absl::flat_hash_map<std::string, uint32_t> open_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_SERVER_STREAM_LIMITER_H_
