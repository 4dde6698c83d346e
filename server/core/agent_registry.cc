#include "server/core/agent_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

absl::Status StaleEpoch(absl::string_view agent_id, uint64_t epoch, uint64_t known) {
  return absl::AbortedError(absl::StrCat("agent ", agent_id, ": epoch ", epoch,
                                         " is stale, the registered epoch is ", known));
}

}  // namespace

AgentRegistry::AgentRegistry(const Clock* clock, absl::Duration heartbeat_timeout,
                             absl::Duration max_epoch_ahead, absl::Duration gone_memory)
    : clock_(clock),
      heartbeat_timeout_(heartbeat_timeout),
      max_epoch_ahead_(max_epoch_ahead),
      gone_memory_(gone_memory) {}

absl::StatusOr<RegisterOutcome> AgentRegistry::CheckRegister(const AgentRegistration& reg) const {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  auto it = agents_.find(reg.agent_id);
  return CheckRegisterLocked(reg, it == agents_.end() ? nullptr : &it->second, now);
}

absl::StatusOr<RegisterOutcome> AgentRegistry::CheckRegisterLocked(const AgentRegistration& reg,
                                                                   const Entry* e,
                                                                   absl::Time now) const {
  const int64_t limit_us = absl::ToUnixMicros(now + max_epoch_ahead_);
  if (limit_us < 0 || reg.epoch > static_cast<uint64_t>(limit_us)) {
    return absl::OutOfRangeError(absl::StrCat(
        "epoch ", reg.epoch, " of agent ", reg.agent_id, " is more than ",
        absl::FormatDuration(max_epoch_ahead_), " ahead of the manager's clock (",
        absl::ToUnixMicros(now),
        " us since the Unix epoch): an epoch is the agent's start time in microseconds since "
        "the Unix epoch; check the clocks of both hosts"));
  }
  if (e == nullptr) return RegisterOutcome{.new_epoch = true};
  if (e->registration.epoch > reg.epoch) {
    return StaleEpoch(reg.agent_id, reg.epoch, e->registration.epoch);
  }
  return RegisterOutcome{.new_epoch = e->dropped || e->registration.epoch != reg.epoch};
}

absl::StatusOr<RegisterOutcome> AgentRegistry::Register(const AgentRegistration& reg) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = agents_.try_emplace(reg.agent_id);
  Entry& e = it->second;
  absl::StatusOr<RegisterOutcome> outcome = CheckRegisterLocked(reg, inserted ? nullptr : &e, now);
  if (!outcome.ok()) {
    if (inserted) agents_.erase(it);
    return outcome;
  }
  if (outcome->new_epoch) {
    e.usage = AgentUsage{};
    e.heartbeats = 0;
    e.dropped = false;
  }
  e.registration = reg;
  e.last_seen = now;
  return outcome;
}

absl::Status AgentRegistry::CheckLive(absl::string_view agent_id, uint64_t epoch) const {
  absl::MutexLock lock(&mu_);
  return CheckLiveLocked(agent_id, epoch);
}

absl::Status AgentRegistry::CheckLiveLocked(absl::string_view agent_id, uint64_t epoch) const {
  auto it = agents_.find(agent_id);
  if (it == agents_.end()) {
    return absl::NotFoundError(
        absl::StrCat("agent ", agent_id, " is not registered (register first)"));
  }
  const Entry& e = it->second;
  if (e.dropped && e.registration.epoch == epoch) {
    return absl::NotFoundError(absl::StrCat(
        "agent ", agent_id, ": epoch ", epoch, " was declared gone after ",
        absl::FormatDuration(heartbeat_timeout_),
        " without a heartbeat and its pages were dropped; register again and report the "
        "inventory"));
  }
  if (e.registration.epoch != epoch) {
    if (epoch < e.registration.epoch) return StaleEpoch(agent_id, epoch, e.registration.epoch);
    return absl::AbortedError(absl::StrCat("agent ", agent_id, ": epoch ", epoch,
                                           " was never registered (registered epoch is ",
                                           e.registration.epoch, "); register again"));
  }
  return absl::OkStatus();
}

absl::Status AgentRegistry::Heartbeat(absl::string_view agent_id, uint64_t epoch,
                                      const AgentUsage& usage) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckLiveLocked(agent_id, epoch); !s.ok()) return s;
  Entry& e = agents_.find(agent_id)->second;
  e.last_seen = now;
  e.usage = usage;
  ++e.heartbeats;
  ++heartbeats_total_;
  return absl::OkStatus();
}

std::optional<AgentPool> AgentRegistry::FindPool(const PoolKey& pool) const {
  absl::MutexLock lock(&mu_);
  auto it = agents_.find(pool.agent_id);
  if (it == agents_.end() || it->second.dropped) return std::nullopt;
  const AgentRegistration& r = it->second.registration;
  uint64_t num_blocks = 0;
  if (pool.tier == r.tier) {
    num_blocks = r.num_blocks;
  } else if (pool.tier == Tier::kHost) {
    num_blocks = r.host_num_blocks;
  }
  if (num_blocks == 0) return std::nullopt;
  return AgentPool{
      .epoch = r.epoch, .bytes_per_block = r.bytes_per_block, .num_blocks = num_blocks};
}

std::vector<AgentRegistration> AgentRegistry::TakeGone() {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  std::vector<AgentRegistration> gone;
  for (auto& [id, e] : agents_) {
    if (e.dropped || Alive(e, now)) continue;
    e.dropped = true;
    e.dropped_at = now;
    gone.push_back(e.registration);
  }
  return gone;
}

std::vector<AgentRegistration> AgentRegistry::TakeForgotten() {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  std::vector<AgentRegistration> forgotten;
  for (auto it = agents_.begin(); it != agents_.end();) {
    if (it->second.dropped && now - it->second.dropped_at >= gone_memory_) {
      forgotten.push_back(std::move(it->second.registration));
      it = agents_.erase(it);
    } else {
      ++it;
    }
  }
  return forgotten;
}

absl::StatusOr<AgentRegistration> AgentRegistry::Forget(absl::string_view agent_id,
                                                        uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  auto it = agents_.find(agent_id);
  if (it == agents_.end()) {
    return absl::NotFoundError(absl::StrCat("agent ", agent_id, " is not registered"));
  }
  if (it->second.registration.epoch != epoch) {
    return StaleEpoch(agent_id, epoch, it->second.registration.epoch);
  }
  AgentRegistration r = std::move(it->second.registration);
  agents_.erase(it);
  return r;
}

absl::StatusOr<AgentInfo> AgentRegistry::ForgetNow(absl::string_view agent_id, bool force) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  auto it = agents_.find(agent_id);
  if (it == agents_.end()) {
    return absl::NotFoundError(absl::StrCat("agent ", agent_id, " is not registered"));
  }
  AgentInfo info = InfoOf(it->second, now);
  if (info.alive && !force) {
    return absl::FailedPreconditionError(absl::StrCat(
        "agent ", agent_id, " epoch ", info.registration.epoch, " is alive (last heartbeat ",
        absl::FormatDuration(info.last_heartbeat_age), " ago): forget it with force"));
  }
  agents_.erase(it);
  return info;
}

std::vector<AgentInfo> AgentRegistry::Snapshot() const {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  std::vector<AgentInfo> out;
  out.reserve(agents_.size());
  for (const auto& [id, e] : agents_) out.push_back(InfoOf(e, now));
  return out;
}

AgentCounts AgentRegistry::Counts() const {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  AgentCounts c;
  for (const auto& [id, e] : agents_) ++(Alive(e, now) ? c.alive : c.gone);
  c.heartbeats_total = heartbeats_total_;
  return c;
}

}  // namespace kvcm
