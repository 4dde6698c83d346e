// The managers' leader election against a real etcd (Debian's etcd-server) on loopback:
// EtcdClient's calls, one leader at a time, takeover on resignation, a leader that cannot
// reach etcd giving up before its lease could lapse, and Stop. Skipped without etcd unless
// KVCM_REQUIRE_ETCD=1.
#include "server/ha/leader_election.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/ha/etcd_client.h"
#include "tests/util/child_process.h"
#include "tests/util/etcd_process.h"

namespace kvcm {
namespace {

using ::kvcm::testing::EtcdProcess;
using ::kvcm::testing::FreePort;
using ::kvcm::testing::WaitUntil;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

class LeaderElectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    etcd_ = EtcdProcess::StartOrSkip();
    if (etcd_ == nullptr) {
      if (!HasFailure()) GTEST_SKIP() << "no etcd (apt-get install etcd-server)";
      return;
    }
  }

  std::unique_ptr<EtcdClient> Client(std::vector<std::string> endpoints = {}) {
    if (endpoints.empty()) endpoints = {etcd_->endpoint()};
    absl::StatusOr<std::unique_ptr<EtcdClient>> c =
        EtcdClient::Create(endpoints, TlsOptions{.insecure = true});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  static LeaderElectionOptions Options(const std::string& candidate) {
    return LeaderElectionOptions{.key = "/kvcm/test/leader",
                                 .candidate = candidate,
                                 .lease_ttl = absl::Seconds(2),
                                 .margin = absl::Milliseconds(200),
                                 .retry_pause = absl::Milliseconds(50)};
  }

  std::unique_ptr<EtcdProcess> etcd_;
};

TEST_F(LeaderElectionTest, ClientCreatesOnceRevokesAndWatchesTheDeletion) {
  std::unique_ptr<EtcdClient> etcd = Client();
  absl::StatusOr<EtcdClient::Lease> a = etcd->Grant(absl::Seconds(5), In(absl::Seconds(5)));
  absl::StatusOr<EtcdClient::Lease> b = etcd->Grant(absl::Seconds(5), In(absl::Seconds(5)));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->ttl, absl::Seconds(5));

  absl::StatusOr<EtcdClient::CreateResult> first =
      etcd->CreateIfAbsent("/k", "a", a->id, In(absl::Seconds(5)));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->created);
  EXPECT_EQ(first->key.value, "a");
  absl::StatusOr<EtcdClient::CreateResult> second =
      etcd->CreateIfAbsent("/k", "b", b->id, In(absl::Seconds(5)));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_FALSE(second->created) << "the key exists: the second candidate must not take it";
  EXPECT_EQ(second->key.value, "a");
  EXPECT_EQ(second->key.lease, a->id);

  // A keep-alive answers at once (not at its deadline) with the lease's full ttl.
  const absl::Time sent = absl::Now();
  absl::StatusOr<absl::Duration> renewed = etcd->KeepAlive(a->id, In(absl::Seconds(5)));
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_EQ(*renewed, absl::Seconds(5));
  EXPECT_LT(absl::Now() - sent, absl::Seconds(1));

  // Revoking the holder's lease deletes the key, which a watcher from before sees.
  std::atomic<bool> deleted{false};
  std::thread watcher([&] {
    deleted = etcd->WaitForDelete("/k", second->key.revision, In(absl::Seconds(10))).ok();
  });
  absl::SleepFor(absl::Milliseconds(200));
  ASSERT_TRUE(etcd->Revoke(a->id, In(absl::Seconds(5))).ok());
  watcher.join();
  EXPECT_TRUE(deleted);
  absl::StatusOr<EtcdClient::Key> gone = etcd->Get("/k", In(absl::Seconds(5)));
  ASSERT_TRUE(gone.ok());
  EXPECT_FALSE(gone->exists);
  // A revoked lease cannot be renewed.
  EXPECT_TRUE(absl::IsNotFound(etcd->KeepAlive(a->id, In(absl::Seconds(5))).status()));
}

TEST_F(LeaderElectionTest, WatchEndsAtItsDeadlineOrOnCancel) {
  std::unique_ptr<EtcdClient> etcd = Client();
  absl::StatusOr<EtcdClient::Key> k = etcd->Get("/nothing", In(absl::Seconds(5)));
  ASSERT_TRUE(k.ok());
  absl::Time start = absl::Now();
  EXPECT_TRUE(absl::IsDeadlineExceeded(
      etcd->WaitForDelete("/nothing", k->revision, In(absl::Milliseconds(300)))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  std::thread cancel([&] {
    absl::SleepFor(absl::Milliseconds(200));
    etcd->Cancel();
  });
  start = absl::Now();
  EXPECT_TRUE(
      absl::IsCancelled(etcd->WaitForDelete("/nothing", k->revision, In(absl::Seconds(30)))));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  cancel.join();
}

TEST_F(LeaderElectionTest, ClientMovesToTheNextEndpointWhenOneIsDown) {
  std::unique_ptr<EtcdClient> etcd =
      Client({absl::StrCat("127.0.0.1:", FreePort()), etcd_->endpoint()});
  absl::Status first = etcd->Get("/", In(absl::Seconds(2))).status();
  EXPECT_TRUE(absl::IsUnavailable(first) || absl::IsDeadlineExceeded(first)) << first;
  EXPECT_EQ(etcd->endpoint(), etcd_->endpoint());
  EXPECT_TRUE(etcd->Get("/", In(absl::Seconds(2))).ok());
}

TEST_F(LeaderElectionTest, OneLeadsTheOtherWaitsAndTakesOverOnResign) {
  std::unique_ptr<EtcdClient> etcd_a = Client();
  std::unique_ptr<EtcdClient> etcd_b = Client();
  LeaderElection a(etcd_a.get(), Options("manager-a:50051"));
  LeaderElection b(etcd_b.get(), Options("manager-b:50051"));
  ASSERT_TRUE(a.Campaign().ok());
  std::atomic<bool> lost{false};
  a.KeepLeading([&] { lost = true; });

  std::atomic<bool> b_leads{false};
  absl::Time b_led;
  std::thread standby([&] {
    b_leads = b.Campaign().ok();
    b_led = absl::Now();
  });
  // Several lease lifetimes pass: a keeps renewing, b keeps waiting.
  absl::SleepFor(absl::Seconds(5));
  EXPECT_TRUE(a.leading());
  EXPECT_FALSE(lost) << "a's renewals failed";
  EXPECT_FALSE(b_leads);
  EXPECT_EQ(b.leader(), "manager-a:50051");

  const absl::Time resigned = absl::Now();
  a.Resign();
  standby.join();
  ASSERT_TRUE(b_leads);
  EXPECT_LT(b_led - resigned, absl::Seconds(1)) << "a resignation needs no lease expiry";
  EXPECT_FALSE(a.leading());
  EXPECT_FALSE(lost);
  absl::StatusOr<EtcdClient::Key> key = etcd_a->Get("/kvcm/test/leader", In(absl::Seconds(5)));
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(key->value, "manager-b:50051");
}

TEST_F(LeaderElectionTest, LeaderThatCannotReachEtcdGivesUpBeforeItsLeaseCouldLapse) {
  std::unique_ptr<EtcdClient> etcd = Client();
  LeaderElection a(etcd.get(), Options("manager-a:50051"));
  ASSERT_TRUE(a.Campaign().ok());
  std::atomic<bool> lost{false};
  absl::Time lost_at;
  a.KeepLeading([&] {
    lost_at = absl::Now();
    lost = true;
  });
  absl::SleepFor(absl::Seconds(1));
  const absl::Time frozen = absl::Now();
  etcd_->Pause(true);
  // The last renewal was sent at most ttl/3 before the freeze; a gives up before its
  // confirmed end (sent + ttl) minus the margin, so within the ttl of the freeze.
  ASSERT_TRUE(WaitUntil([&] { return lost.load(); }, absl::Seconds(5)));
  etcd_->Pause(false);
  EXPECT_LT(lost_at - frozen, absl::Seconds(2));
  EXPECT_FALSE(a.leading());
}

TEST_F(LeaderElectionTest, StopEndsACampaign) {
  std::unique_ptr<EtcdClient> etcd = Client();
  LeaderElection a(etcd.get(), Options("manager-a:50051"));
  ASSERT_TRUE(a.Campaign().ok());
  std::unique_ptr<EtcdClient> etcd_b = Client();
  LeaderElection b(etcd_b.get(), Options("manager-b:50051"));
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(300));
    b.Stop();
  });
  const absl::Time start = absl::Now();
  EXPECT_TRUE(absl::IsCancelled(b.Campaign()));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  stopper.join();
  a.Resign();
}

}  // namespace
}  // namespace kvcm
