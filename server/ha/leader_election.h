// LeaderElection: one kvcm-manager of several leads, by holding an etcd key attached to its
// lease (docs/OPERATIONS.md "High availability").
//
//   Campaign   grant a lease; create the key with this manager's address if it is absent
//              (one transaction); if another manager holds it, revoke the lease and watch
//              the key until it is deleted (its holder resigned or its lease expired), then
//              try again. Returns once this manager leads.
//   KeepLeading  renews the lease every ttl/3 on a thread. The lease is confirmed until
//              (time the renewal was sent + granted ttl): etcd cannot expire it before. When
//              that moment comes within `margin` without a new confirmation, on_lost runs
//              once: the caller must stop serving at once, so that two managers never serve
//              together (etcd may hand the key to a standby right after).
//   Resign     stops the renewals and revokes the lease: the key goes at once and a standby
//              leads without waiting out the ttl.
//
// Thread-safe. Stop() ends a Campaign in progress (CANCELLED) and the renewals.
#ifndef KVCM_SERVER_HA_LEADER_ELECTION_H_
#define KVCM_SERVER_HA_LEADER_ELECTION_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/ha/etcd_client.h"

namespace prometheus {
class Registry;
template <typename T>
class Family;
class Counter;
class Gauge;
}  // namespace prometheus

namespace kvcm {

struct LeaderElectionOptions {
  // The key every manager of one cluster campaigns for.
  std::string key = "/kvcm/manager/leader";
  // What this manager writes there when it leads: the address clients reach it at.
  std::string candidate;
  // The lease etcd keeps the key for after the leader's last renewal.
  absl::Duration lease_ttl = absl::Seconds(5);
  // How long before the confirmed end of the lease the leader gives up (on_lost).
  absl::Duration margin = absl::Milliseconds(500);
  // Pause after a failed etcd call before the next try.
  absl::Duration retry_pause = absl::Milliseconds(200);
};

// kvcm_manager_leader (1 leading, 0 standby), kvcm_etcd_requests_total{op,code}.
class LeaderElectionMetrics {
 public:
  explicit LeaderElectionMetrics(prometheus::Registry& registry);
  void SetLeader(bool leader);
  void CountRequest(absl::string_view op, const absl::Status& status);

 private:
  prometheus::Gauge* leader_;
  prometheus::Family<prometheus::Counter>* requests_;
};

class LeaderElection {
 public:
  // `etcd` and `metrics` (may be null) must outlive this.
  LeaderElection(EtcdClient* etcd, LeaderElectionOptions options,
                 LeaderElectionMetrics* metrics = nullptr);
  // Stops; does not resign (a leader destroyed without Resign keeps the key until its
  // lease expires).
  ~LeaderElection();
  LeaderElection(const LeaderElection&) = delete;
  LeaderElection& operator=(const LeaderElection&) = delete;

  // Blocks until this candidate leads (OK) or Stop() is called (CANCELLED). etcd errors
  // are logged and retried.
  absl::Status Campaign() ABSL_LOCKS_EXCLUDED(mu_);

  // REQUIRES: Campaign returned OK. Starts the renewals; `on_lost` runs at most once, on
  // the renewal thread, when leadership can no longer be confirmed.
  void KeepLeading(std::function<void()> on_lost) ABSL_LOCKS_EXCLUDED(mu_);

  // Stops the renewals and, when leading, revokes the lease (bounded by the lease ttl).
  void Resign() ABSL_LOCKS_EXCLUDED(mu_);

  // Ends Campaign and the renewals. Idempotent.
  void Stop();

  bool leading() const ABSL_LOCKS_EXCLUDED(mu_);
  // The value of the key last seen held by another candidate ("" if none).
  std::string leader() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Renew(std::function<void()> on_lost);
  void Count(absl::string_view op, const absl::Status& status);
  // Sleeps retry_pause unless stopped; false when stopped.
  bool Pause();

  EtcdClient* const etcd_;
  const LeaderElectionOptions options_;
  LeaderElectionMetrics* const metrics_;

  absl::Notification stop_;
  std::thread renewer_;

  mutable absl::Mutex mu_;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  bool leading_ ABSL_GUARDED_BY(mu_) = false;
  // The lease is alive at etcd at least until then.
  absl::Time confirmed_until_ ABSL_GUARDED_BY(mu_);
  absl::Duration granted_ttl_ ABSL_GUARDED_BY(mu_);
  std::string leader_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_SERVER_HA_LEADER_ELECTION_H_
