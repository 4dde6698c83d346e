// NcclLink on real GPUs. Label `gpu`: every test skips, saying why, on a machine with fewer
// CUDA devices than it needs (NCCL cannot put both ranks of a communicator on one GPU, so a
// pair needs two). Never run on the development machines, which have no GPU.
#include "gpu/agent/transport/nccl/nccl_link.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;  // no driver or no device: "no device" (ARCHITECTURE.md §12)
  }
  return n;
}

#define KVCM_REQUIRE_GPUS(n)                                                                \
  do {                                                                                      \
    if (const int have = DeviceCount(); have < (n)) {                                       \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices (NCCL puts each rank of a link on " \
                   << "its own GPU); this machine has " << have;                            \
    }                                                                                       \
  } while (0)

constexpr uint64_t kStaging = 3 << 20;

// Both ends of one link, made concurrently (each join waits for the other).
struct Pair {
  std::unique_ptr<BlockLink> ends[2];
};

Pair Connect(absl::Duration timeout) {
  Pair p;
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return p;
  std::atomic<bool> stop{false};
  absl::StatusOr<std::unique_ptr<BlockLink>> made[2];
  std::thread threads[2];
  for (int r = 0; r < 2; ++r) {
    threads[r] = std::thread([&, r] {
      made[r] = MakeNcclLink({.device = r, .staging_bytes = kStaging, .connect_timeout = timeout},
                             *id, r, stop);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(made[r].ok()) << "rank " << r << ": " << made[r].status();
    if (made[r].ok()) p.ends[r] = *std::move(made[r]);
  }
  return p;
}

TEST(NcclLinkTest, ChunksMoveBitForBitBetweenTwoGpus) {
  KVCM_REQUIRE_GPUS(2);
  Pair p = Connect(absl::Seconds(60));
  ASSERT_TRUE(p.ends[0] && p.ends[1]);
  std::vector<std::byte> sent(kStaging), got(kStaging);
  for (int round = 0; round < 3; ++round) {
    const uint64_t bytes = kStaging - round * 4096;
    for (size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<std::byte>(i * 31 + round);
    // Host memory in, host memory out: StageIn / StageOut take any pointer (cudaMemcpyDefault).
    ASSERT_TRUE(p.ends[1]->StageIn(sent.data(), 0, bytes).ok());
    absl::Status send_status, recv_status;
    std::thread sender([&] { send_status = p.ends[1]->Send(bytes, absl::Seconds(30), nullptr); });
    recv_status = p.ends[0]->Recv(bytes, absl::Seconds(30), nullptr);
    sender.join();
    ASSERT_TRUE(send_status.ok()) << send_status;
    ASSERT_TRUE(recv_status.ok()) << recv_status;
    std::fill(got.begin(), got.end(), std::byte{0});
    ASSERT_TRUE(p.ends[0]->StageOut(0, got.data(), bytes).ok());
    EXPECT_EQ(std::vector<std::byte>(got.begin(), got.begin() + bytes),
              std::vector<std::byte>(sent.begin(), sent.begin() + bytes))
        << "round " << round;
  }
}

TEST(NcclLinkTest, AReceiveNobodySendsTimesOutInsteadOfBlocking) {
  KVCM_REQUIRE_GPUS(2);
  Pair p = Connect(absl::Seconds(60));
  ASSERT_TRUE(p.ends[0] && p.ends[1]);
  const absl::Time start = absl::Now();
  const absl::Status s = p.ends[0]->Recv(1024, absl::Milliseconds(300), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // A check's error ends a wait too.
  const absl::Status checked =
      p.ends[1]->Recv(1024, absl::Seconds(30), [] { return absl::UnavailableError("gone"); });
  EXPECT_EQ(checked.code(), absl::StatusCode::kUnavailable) << checked;
  // Destroying the broken ends aborts their communicator without hanging.
  p.ends[0].reset();
  p.ends[1].reset();
}

TEST(NcclLinkTest, AJoinWithoutAPeerTimesOutOrStops) {
  KVCM_REQUIRE_GPUS(1);
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::atomic<bool> stop{false};
  absl::StatusOr<std::unique_ptr<BlockLink>> alone = MakeNcclLink(
      {.device = 0, .staging_bytes = 1 << 20, .connect_timeout = absl::Milliseconds(500)}, *id, 0,
      stop);
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded) << alone.status();
  stop = true;
  absl::StatusOr<std::string> id2 = NewNcclUniqueId();
  ASSERT_TRUE(id2.ok());
  absl::StatusOr<std::unique_ptr<BlockLink>> stopped = MakeNcclLink(
      {.device = 0, .staging_bytes = 1 << 20, .connect_timeout = absl::Seconds(30)}, *id2, 0, stop);
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled) << stopped.status();
  EXPECT_EQ(MakeNcclLink({}, "short", 0, stop).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcm
