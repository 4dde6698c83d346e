#include "server/core/engine_sessions.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

constexpr Tier kEngineTiers[] = {Tier::kGpu, Tier::kHost, Tier::kDisk};

}  // namespace

EngineSessions::EngineSessions(CacheIndex* index, Clock* clock, absl::Duration default_ttl)
    : index_(index), clock_(clock), default_ttl_(default_ttl) {
  assert(default_ttl > absl::ZeroDuration() && default_ttl <= kMaxEngineSessionTtl);
}

absl::StatusOr<EnginePublishResult> EngineSessions::Publish(const EnginePublish& req) {
  // What can refuse the request is checked before anything changes.
  if (absl::StatusOr<RegisterModelResult> ns = index_->GetNamespace(req.ns); !ns.ok()) {
    return ns.status();
  }
  for (Tier tier : kEngineTiers) {
    if (absl::Status s = index_->CheckEnginePool(PoolKey{req.engine_id, tier}); !s.ok()) return s;
  }

  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  EnginePublishResult result;
  auto it = sessions_.find(req.engine_id);
  if (it == sessions_.end() || it->second.session != req.session) {
    if (req.sequence != 1) {
      ++counts_.refused_sequence;
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence: session ", req.session, " of engine ", req.engine_id,
          " is unknown to the manager (it restarted, or the session lapsed or was replaced); "
          "start a new session at sequence 1 and send the engine's whole state"));
    }
    if (it != sessions_.end()) {
      ClearPools(req.engine_id, it->second);  // the old session's view is void
      sessions_.erase(it);
    }
    it = sessions_.emplace(req.engine_id, Session{.ns = req.ns, .session = req.session}).first;
    result.new_session = true;
    ++counts_.started;
  } else {
    Session& s = it->second;
    if (s.ns != req.ns) {
      return absl::InvalidArgumentError(
          absl::StrCat("namespace: engine ", req.engine_id, " publishes into ", s.ns.ToString(),
                       " in session ", s.session, ", not into ", req.ns.ToString()));
    }
    if (req.sequence == s.sequence) {
      s.last_publish = now;  // a retried request whose answer was lost: applied once
      result.duplicate = true;
      result.pages = PagesOf(req.engine_id);
      return result;
    }
    if (req.sequence != s.sequence + 1) {
      ++counts_.refused_sequence;
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence: engine ", req.engine_id, " session ", s.session, " expected ", s.sequence + 1,
          ", got ", req.sequence,
          " (a request was lost); start a new session and send the engine's whole state"));
    }
  }

  Session& s = it->second;
  for (size_t i = 0; i < req.changes.size(); ++i) {
    const EngineChange& change = req.changes[i];
    const PoolKey pool{req.engine_id, change.tier};
    absl::StatusOr<uint64_t> n;
    switch (change.kind) {
      case EngineChange::Kind::kStored:
        n = index_->StoreEnginePages(s.ns, change.pages, pool);
        if (n.ok()) result.stored_pages += *n;
        break;
      case EngineChange::Kind::kRemoved:
        n = index_->RemoveEnginePages(s.ns, change.pages, pool);
        if (n.ok()) result.removed_pages += *n;
        break;
      case EngineChange::Kind::kCleared:
        n = index_->ClearEnginePool(s.ns, pool);
        if (n.ok()) result.removed_pages += *n;
        break;
    }
    if (!n.ok()) {
      // Half applied: the manager no longer knows what the engine holds.
      ClearPools(req.engine_id, s);
      sessions_.erase(it);
      return absl::Status(n.status().code(),
                          absl::StrCat("changes[", i, "]: ", n.status().message(),
                                       " (the session ended; start a new one)"));
    }
  }
  counts_.stored_pages += result.stored_pages;
  counts_.removed_pages += result.removed_pages;
  s.sequence = req.sequence;
  s.last_publish = now;
  s.ttl = req.ttl > absl::ZeroDuration() ? req.ttl : default_ttl_;
  if (req.close) {
    ClearPools(req.engine_id, s);
    sessions_.erase(it);
  }
  result.pages = PagesOf(req.engine_id);
  return result;
}

std::vector<EngineSessionInfo> EngineSessions::ExpireIdle() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  std::vector<EngineSessionInfo> ended;
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (now - it->second.last_publish <= it->second.ttl) {
      ++it;
      continue;
    }
    ended.push_back(InfoOf(it->first, it->second));
    ++counts_.lapsed;
    ClearPools(it->first, it->second);
    sessions_.erase(it++);
  }
  return ended;
}

bool EngineSessions::IsLive(absl::string_view engine_id) const {
  absl::ReaderMutexLock lock(&mu_);
  return sessions_.contains(engine_id);
}

std::vector<EngineSessionInfo> EngineSessions::Snapshot() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<EngineSessionInfo> out;
  out.reserve(sessions_.size());
  for (const auto& [id, s] : sessions_) out.push_back(InfoOf(id, s));
  std::sort(out.begin(), out.end(), [](const EngineSessionInfo& a, const EngineSessionInfo& b) {
    return a.engine_id < b.engine_id;
  });
  return out;
}

EngineCounts EngineSessions::Counts() const {
  absl::ReaderMutexLock lock(&mu_);
  EngineCounts c = counts_;
  c.live = sessions_.size();
  return c;
}

void EngineSessions::ClearPools(const std::string& engine_id, const Session& s) {
  for (Tier tier : kEngineTiers) {
    // NOT_FOUND: the namespace was deleted, and its pages with it.
    (void)index_->ClearEnginePool(s.ns, PoolKey{engine_id, tier});
  }
}

uint64_t EngineSessions::PagesOf(const std::string& engine_id) const {
  uint64_t pages = 0;
  for (Tier tier : kEngineTiers) pages += index_->PoolPages(PoolKey{engine_id, tier});
  return pages;
}

EngineSessionInfo EngineSessions::InfoOf(const std::string& engine_id, const Session& s) const {
  return EngineSessionInfo{.engine_id = engine_id,
                           .ns = s.ns,
                           .session = s.session,
                           .sequence = s.sequence,
                           .last_publish = s.last_publish,
                           .ttl = s.ttl,
                           .pages = PagesOf(engine_id)};
}

}  // namespace kvcm
