#include "gpu/agent/transport/link_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcm {

absl::Status ValidateLinkOffer(const LinkOffer& offer) {
  if (offer.from_agent_id.empty() || offer.from_agent_id.size() > 128) {
    return absl::InvalidArgumentError("nccl_connect.from_agent_id must be 1..128 bytes");
  }
  if (offer.link_id == 0) return absl::InvalidArgumentError("nccl_connect.link_id must be != 0");
  if (offer.unique_id.size() != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl_connect.unique_id must be 128 bytes, got ", offer.unique_id.size()));
  }
  if (offer.nranks != 2 || (offer.rank != 0 && offer.rank != 1) ||
      offer.peer_rank != 1 - offer.rank) {
    return absl::InvalidArgumentError(absl::StrCat("nccl_connect ranks must be {0, 1} of 2, got ",
                                                   offer.rank, " and ", offer.peer_rank, " of ",
                                                   offer.nranks));
  }
  return absl::OkStatus();
}

LinkCache::Lease::Lease(Lease&& other) noexcept
    : cache_(std::exchange(other.cache_, nullptr)),
      pull_(other.pull_),
      key_(std::move(other.key_)),
      link_id_(other.link_id_),
      peer_agent_id_(std::move(other.peer_agent_id_)),
      link_(other.link_),
      broken_(other.broken_) {}

LinkCache::Lease::~Lease() {
  if (cache_ != nullptr) cache_->Release(*this);
}

LinkCache::LinkCache(LinkCacheOptions options, Connector connect)
    : options_(options), connect_(std::move(connect)) {}

LinkCache::~LinkCache() {
  CancelAll();
  std::list<Worker> workers;
  {
    absl::MutexLock lock(&mu_);
    workers.swap(workers_);
  }
  for (Worker& w : workers) w.thread.join();
}

template <typename Find>
absl::StatusOr<LinkCache::Entry*> LinkCache::AwaitIdle(Find find, absl::Duration wait) {
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (cancelled_) return true;
    const Entry* e = find();
    return e == nullptr || (e->link != nullptr && !e->leased);
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), wait)) {
    return absl::DeadlineExceededError(
        absl::StrCat("no link became free within ", absl::FormatDuration(wait)));
  }
  if (cancelled_) return absl::CancelledError("the transport is stopping");
  return find();
}

template <typename Map>
absl::Status LinkCache::MakeRoom(Map& map, std::list<std::unique_ptr<BlockLink>>& dropped) {
  if (map.size() < options_.max_links) return absl::OkStatus();
  auto victim = map.end();
  for (auto it = map.begin(); it != map.end(); ++it) {
    const Entry& e = it->second;
    if (e.link != nullptr && !e.leased &&
        (victim == map.end() || e.last_used < victim->second.last_used)) {
      victim = it;
    }
  }
  if (victim == map.end()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", options_.max_links, " links are in use (max_links)"));
  }
  dropped.push_back(std::move(victim->second.link));
  map.erase(victim);
  return absl::OkStatus();
}

absl::StatusOr<LinkCache::Lease> LinkCache::LeasePull(const std::string& peer_address,
                                                      absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  auto find = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> Entry* {
    auto it = pull_.find(peer_address);
    return it == pull_.end() ? nullptr : &it->second;
  };
  absl::StatusOr<Entry*> e = AwaitIdle(find, wait);
  if (!e.ok()) return e.status();
  if (*e == nullptr) {
    return absl::NotFoundError(absl::StrCat("no link to ", peer_address));
  }
  Entry& entry = **e;
  entry.leased = true;
  return Lease(this, /*pull=*/true, peer_address, entry.link_id, entry.peer_agent_id,
               entry.link.get());
}

absl::StatusOr<LinkCache::Lease> LinkCache::ConnectPull(const std::string& peer_address,
                                                        const std::string& peer_agent_id,
                                                        uint64_t stale_link_id,
                                                        absl::Duration wait) {
  std::list<std::unique_ptr<BlockLink>> dropped;  // destroyed (aborted) after mu_
  uint64_t link_id = 0;
  Entry* entry = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto find = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> Entry* {
      auto it = pull_.find(peer_address);
      return it == pull_.end() ? nullptr : &it->second;
    };
    absl::StatusOr<Entry*> e = AwaitIdle(find, wait);
    if (!e.ok()) return e.status();
    if (*e != nullptr && (*e)->link_id != stale_link_id && (*e)->peer_agent_id == peer_agent_id) {
      (*e)->leased = true;  // another pull replaced the stale link already
      return Lease(this, /*pull=*/true, peer_address, (*e)->link_id, (*e)->peer_agent_id,
                   (*e)->link.get());
    }
    if (*e != nullptr) {
      dropped.push_back(std::move((*e)->link));
      pull_.erase(peer_address);
    }
    if (absl::Status s = MakeRoom(pull_, dropped); !s.ok()) return s;
    // Unique across restarts of this agent: a server may still hold a link of a
    // predecessor process under an older id.
    link_id = std::max(tick_ + 1, static_cast<uint64_t>(absl::ToUnixMicros(absl::Now())));
    tick_ = link_id;
    entry = &pull_[peer_address];
    entry->link_id = link_id;
    entry->peer_agent_id = peer_agent_id;
    entry->leased = true;  // connecting: no link yet, nobody else may take it
  }
  dropped.clear();
  absl::StatusOr<std::unique_ptr<BlockLink>> link = connect_(peer_agent_id, link_id, stop_);
  absl::MutexLock lock(&mu_);
  if (!link.ok() || *link == nullptr) {
    pull_.erase(peer_address);  // the connecting entry is ours: nobody else erased it
    return link.ok() ? absl::InternalError("the connector returned no link") : link.status();
  }
  entry->link = *std::move(link);
  if (cancelled_) entry->link->Cancel();
  return Lease(this, /*pull=*/true, peer_address, link_id, peer_agent_id, entry->link.get());
}

absl::Status LinkCache::OfferServed(const std::string& puller, uint64_t link_id, LinkMaker join) {
  JoinFinishedWorkers();
  std::list<std::unique_ptr<BlockLink>> dropped;
  absl::MutexLock lock(&mu_);
  if (cancelled_) return absl::CancelledError("the transport is stopping");
  const ServedKey key{puller, link_id};
  if (served_.contains(key)) {
    return absl::AlreadyExistsError(absl::StrCat("link ", link_id, " of ", puller, " is known"));
  }
  for (auto it = served_.begin(); it != served_.end();) {
    if (it->first.first == puller && it->second.link != nullptr && !it->second.leased) {
      dropped.push_back(std::move(it->second.link));
      it = served_.erase(it);
    } else {
      ++it;
    }
  }
  if (absl::Status s = MakeRoom(served_, dropped); !s.ok()) return s;
  Entry& entry = served_[key];
  entry.link_id = link_id;
  entry.peer_agent_id = puller;
  entry.leased = true;  // joining
  auto finished = std::make_shared<std::atomic<bool>>(false);
  workers_.push_back(Worker{std::thread([this, key, join = std::move(join), finished] {
                              absl::StatusOr<std::unique_ptr<BlockLink>> link = join(stop_);
                              {
                                absl::MutexLock lock(&mu_);
                                auto it = served_.find(key);
                                if (!link.ok() || *link == nullptr) {
                                  served_.erase(it);
                                } else {
                                  it->second.link = *std::move(link);
                                  it->second.leased = false;
                                  it->second.last_used = ++tick_;
                                  if (cancelled_) it->second.link->Cancel();
                                }
                              }
                              finished->store(true);
                            }),
                            finished});
  return absl::OkStatus();
}

absl::StatusOr<LinkCache::Lease> LinkCache::LeaseServed(const std::string& puller, uint64_t link_id,
                                                        absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  const ServedKey key{puller, link_id};
  auto find = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> Entry* {
    auto it = served_.find(key);
    return it == served_.end() ? nullptr : &it->second;
  };
  absl::StatusOr<Entry*> e = AwaitIdle(find, wait);
  if (!e.ok()) return e.status();
  if (*e == nullptr) {
    return absl::NotFoundError(absl::StrCat("no link ", link_id, " of ", puller));
  }
  (*e)->leased = true;
  return Lease(this, /*pull=*/false, puller, link_id, puller, (*e)->link.get());
}

void LinkCache::Release(Lease& lease) {
  std::unique_ptr<BlockLink> dropped;  // destroyed (aborted) after mu_
  absl::MutexLock lock(&mu_);
  Entry* e = nullptr;
  if (lease.pull_) {
    auto it = pull_.find(lease.key_);
    if (it != pull_.end()) e = &it->second;
  } else {
    auto it = served_.find({lease.key_, lease.link_id_});
    if (it != served_.end()) e = &it->second;
  }
  if (e == nullptr || e->link.get() != lease.link_) return;
  if (lease.broken_) {
    dropped = std::move(e->link);
    if (lease.pull_) {
      pull_.erase(lease.key_);
    } else {
      served_.erase({lease.key_, lease.link_id_});
    }
    return;
  }
  e->leased = false;
  e->last_used = ++tick_;
}

void LinkCache::CancelAll() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  stop_.store(true);
  for (auto& [key, e] : pull_) {
    if (e.link != nullptr) e.link->Cancel();
  }
  for (auto& [key, e] : served_) {
    if (e.link != nullptr) e.link->Cancel();
  }
}

void LinkCache::JoinFinishedWorkers() {
  std::list<Worker> finished;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = workers_.begin(); it != workers_.end();) {
      auto next = std::next(it);
      if (it->finished->load()) finished.splice(finished.end(), workers_, it);
      it = next;
    }
  }
  for (Worker& w : finished) w.thread.join();
}

size_t LinkCache::pull_links() const {
  absl::MutexLock lock(&mu_);
  return pull_.size();
}

size_t LinkCache::served_links() const {
  absl::MutexLock lock(&mu_);
  return served_.size();
}

}  // namespace kvcm
