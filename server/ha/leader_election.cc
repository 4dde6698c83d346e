#include "server/ha/leader_election.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace kvcm {

LeaderElectionMetrics::LeaderElectionMetrics(prometheus::Registry& registry)
    : leader_(&prometheus::BuildGauge()
                   .Name("kvcm_manager_leader")
                   .Help("1 while this manager leads (serves), 0 while it is a standby.")
                   .Register(registry)
                   .Add({})),
      requests_(&prometheus::BuildCounter()
                     .Name("kvcm_etcd_requests_total")
                     .Help("etcd calls of the leader election, by operation and gRPC code.")
                     .Register(registry)) {}

void LeaderElectionMetrics::SetLeader(bool leader) { leader_->Set(leader ? 1 : 0); }

void LeaderElectionMetrics::CountRequest(absl::string_view op, const absl::Status& status) {
  requests_->Add({{"op", std::string(op)}, {"code", absl::StatusCodeToString(status.code())}})
      .Increment();
}

LeaderElection::LeaderElection(EtcdClient* etcd, LeaderElectionOptions options,
                               LeaderElectionMetrics* metrics)
    : etcd_(etcd), options_(std::move(options)), metrics_(metrics) {
  if (metrics_ != nullptr) metrics_->SetLeader(false);
}

LeaderElection::~LeaderElection() {
  Stop();
  if (renewer_.joinable()) renewer_.join();
}

void LeaderElection::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  etcd_->Cancel();
}

bool LeaderElection::leading() const {
  absl::MutexLock lock(&mu_);
  return leading_;
}

std::string LeaderElection::leader() const {
  absl::MutexLock lock(&mu_);
  return leader_;
}

void LeaderElection::Count(absl::string_view op, const absl::Status& status) {
  if (metrics_ != nullptr) metrics_->CountRequest(op, status);
}

bool LeaderElection::Pause() { return !stop_.WaitForNotificationWithTimeout(options_.retry_pause); }

absl::Status LeaderElection::Campaign() {
  const absl::Duration call_timeout = options_.lease_ttl;
  std::string announced;  // the holder last logged, to log each leader once
  while (!stop_.HasBeenNotified()) {
    const absl::Time asked = absl::Now();
    absl::StatusOr<EtcdClient::Lease> lease =
        etcd_->Grant(options_.lease_ttl, asked + call_timeout);
    Count("LeaseGrant", lease.status());
    if (!lease.ok()) {
      LogWarning(absl::StrCat("election: ", lease.status().ToString()));
      if (!Pause()) break;
      continue;
    }
    absl::StatusOr<EtcdClient::CreateResult> created = etcd_->CreateIfAbsent(
        options_.key, options_.candidate, lease->id, absl::Now() + call_timeout);
    Count("Txn", created.status());
    if (created.ok() && created->created) {
      absl::MutexLock lock(&mu_);
      lease_ = lease->id;
      leading_ = true;
      granted_ttl_ = lease->ttl;
      // The lease runs from when etcd granted it, which is after `asked`.
      confirmed_until_ = asked + lease->ttl;
      leader_ = options_.candidate;
      if (metrics_ != nullptr) metrics_->SetLeader(true);
      LogInfo(absl::StrCat("election: leading (", options_.key, " = ", options_.candidate,
                           ", lease ", lease->id, " of ", absl::FormatDuration(lease->ttl), ")"));
      return absl::OkStatus();
    }
    // Not ours: give the lease back rather than let it linger for its ttl.
    Count("LeaseRevoke", etcd_->Revoke(lease->id, absl::Now() + call_timeout));
    if (!created.ok()) {
      LogWarning(absl::StrCat("election: ", created.status().ToString()));
      if (!Pause()) break;
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      leader_ = created->key.value;
    }
    if (created->key.value != announced) {
      announced = created->key.value;
      LogInfo(absl::StrCat("election: standby; ", options_.key, " is held by \"", announced, "\""));
    }
    // Wake at least once a minute to look again, should a watch have silently died.
    absl::Status deleted =
        etcd_->WaitForDelete(options_.key, created->key.revision, absl::Now() + absl::Minutes(1));
    if (deleted.ok() || absl::IsDeadlineExceeded(deleted)) continue;
    if (absl::IsCancelled(deleted)) break;
    Count("Watch", deleted);
    LogWarning(absl::StrCat("election: ", deleted.ToString()));
    if (!Pause()) break;
  }
  return absl::CancelledError("election stopped before this manager led");
}

void LeaderElection::KeepLeading(std::function<void()> on_lost) {
  renewer_ = std::thread([this, on_lost = std::move(on_lost)] { Renew(on_lost); });
}

void LeaderElection::Renew(std::function<void()> on_lost) {
  int64_t lease = 0;
  absl::Duration ttl;
  {
    absl::MutexLock lock(&mu_);
    lease = lease_;
    ttl = granted_ttl_;
  }
  const absl::Duration interval = ttl / 3;
  while (!stop_.WaitForNotificationWithTimeout(interval)) {
    absl::Time give_up;
    {
      absl::MutexLock lock(&mu_);
      give_up = confirmed_until_ - options_.margin;
    }
    // Retry until renewed or out of time: each try may take no later than give_up.
    while (!stop_.HasBeenNotified()) {
      const absl::Time sent = absl::Now();
      if (sent >= give_up) {
        LogError(
            absl::StrCat("election: lease ", lease, " not renewed in time; giving up the lead"));
        {
          absl::MutexLock lock(&mu_);
          leading_ = false;
        }
        if (metrics_ != nullptr) metrics_->SetLeader(false);
        on_lost();
        return;
      }
      absl::StatusOr<absl::Duration> renewed = etcd_->KeepAlive(lease, give_up);
      Count("LeaseKeepAlive", renewed.status());
      if (renewed.ok()) {
        absl::MutexLock lock(&mu_);
        confirmed_until_ = sent + *renewed;
        break;
      }
      LogWarning(absl::StrCat("election: ", renewed.status().ToString()));
      if (absl::IsNotFound(renewed.status())) {
        give_up = sent;  // etcd says the lease is gone: give up now
        continue;
      }
      stop_.WaitForNotificationWithTimeout(
          std::min(options_.retry_pause, std::max(give_up - absl::Now(), absl::ZeroDuration())));
    }
  }
}

void LeaderElection::Resign() {
  Stop();
  if (renewer_.joinable()) renewer_.join();
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!leading_) return;
    leading_ = false;
    lease = lease_;
  }
  if (metrics_ != nullptr) metrics_->SetLeader(false);
  // Stop() cancelled watches only; unary calls still go through.
  absl::Status s = etcd_->Revoke(lease, absl::Now() + options_.lease_ttl);
  Count("LeaseRevoke", s);
  if (s.ok()) {
    LogInfo(absl::StrCat("election: resigned (lease ", lease, " revoked)"));
  } else {
    LogWarning(absl::StrCat("election: resign: ", s.ToString(), "; the key lapses with its lease"));
  }
}

}  // namespace kvcm
