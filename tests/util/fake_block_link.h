// Test-only BlockLinks in host memory: a pair whose Send delivers the sender's staging bytes
// to the peer's Recv, as one NCCL communicator of two ranks would, with knobs to stall or
// lose a send. Header-only; used by link_cache_test.cc and link_transfer_test.cc.
#ifndef KVCM_TESTS_UTIL_FAKE_BLOCK_LINK_H_
#define KVCM_TESTS_UTIL_FAKE_BLOCK_LINK_H_

#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gpu/agent/transport/block_link.h"

namespace kvcm::testing {

// What both ends of a pair share: a queue of messages per direction and counters.
struct FakeWire {
  absl::Mutex mu;
  std::deque<std::vector<std::byte>> to[2] ABSL_GUARDED_BY(mu);  // to[r]: messages for rank r
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<int> destroyed{0};
  // Sends of either end block until cleared (an NCCL op that does not complete).
  std::atomic<bool> stall_sends{false};
  // Sends of either end are lost (the receiver waits in vain).
  std::atomic<bool> lose_sends{false};
};

class FakeBlockLink final : public BlockLink {
 public:
  FakeBlockLink(std::shared_ptr<FakeWire> wire, int rank, uint64_t staging_bytes)
      : wire_(std::move(wire)), rank_(rank), staging_(staging_bytes) {}
  ~FakeBlockLink() override { ++wire_->destroyed; }

  // Two ends of one link, ranks 0 and 1.
  static std::pair<std::unique_ptr<FakeBlockLink>, std::unique_ptr<FakeBlockLink>> Pair(
      uint64_t staging_bytes, std::shared_ptr<FakeWire> wire = std::make_shared<FakeWire>()) {
    return {std::make_unique<FakeBlockLink>(wire, 0, staging_bytes),
            std::make_unique<FakeBlockLink>(wire, 1, staging_bytes)};
  }

  uint64_t staging_bytes() const override { return staging_.size(); }

  absl::Status StageIn(const std::byte* src, uint64_t offset, uint64_t bytes) override {
    if (offset + bytes > staging_.size()) return absl::OutOfRangeError("staging");
    std::memcpy(staging_.data() + offset, src, bytes);
    return absl::OkStatus();
  }
  absl::Status StageOut(uint64_t offset, std::byte* dst, uint64_t bytes) override {
    if (offset + bytes > staging_.size()) return absl::OutOfRangeError("staging");
    std::memcpy(dst, staging_.data() + offset, bytes);
    return absl::OkStatus();
  }

  absl::Status Send(uint64_t bytes, absl::Duration timeout, const WaitCheck& check) override {
    if (bytes > staging_.size()) return absl::OutOfRangeError("staging");
    const absl::Time deadline = absl::Now() + timeout;
    while (wire_->stall_sends.load()) {
      if (absl::Status s = Poll(deadline, check); !s.ok()) return s;
    }
    if (cancelled_.load()) return absl::CancelledError("link cancelled");
    if (!wire_->lose_sends.load()) {
      absl::MutexLock lock(&wire_->mu);
      wire_->to[1 - rank_].emplace_back(staging_.begin(), staging_.begin() + bytes);
    }
    wire_->bytes_sent += bytes;
    return absl::OkStatus();
  }

  absl::Status Recv(uint64_t bytes, absl::Duration timeout, const WaitCheck& check) override {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      {
        absl::MutexLock lock(&wire_->mu);
        auto& inbox = wire_->to[rank_];
        if (!inbox.empty()) {
          std::vector<std::byte> m = std::move(inbox.front());
          inbox.pop_front();
          if (m.size() != bytes) {
            return absl::DataLossError(
                absl::StrCat("received ", m.size(), " bytes, expected ", bytes));
          }
          std::memcpy(staging_.data(), m.data(), m.size());
          return absl::OkStatus();
        }
      }
      if (absl::Status s = Poll(deadline, check); !s.ok()) return s;
    }
  }

  void Cancel() override { cancelled_.store(true); }

 private:
  absl::Status Poll(absl::Time deadline, const WaitCheck& check) {
    if (cancelled_.load()) return absl::CancelledError("link cancelled");
    if (absl::Now() > deadline) return absl::DeadlineExceededError("link op timed out");
    if (check) {
      if (absl::Status s = check(); !s.ok()) return s;
    }
    absl::SleepFor(absl::Milliseconds(1));
    return absl::OkStatus();
  }

  const std::shared_ptr<FakeWire> wire_;
  const int rank_;
  std::vector<std::byte> staging_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_FAKE_BLOCK_LINK_H_
