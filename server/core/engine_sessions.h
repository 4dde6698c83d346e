// EngineSessions: the engines whose prefix caches the index mirrors (PublishEngineEvents),
// each through one session of numbered requests from the bridge that follows its events.
//
// The engine is the truth of its pools; the session is how the manager knows it is still
// hearing that truth whole. A new session starts from nothing (the engine's pools are
// emptied, then its bridge sends everything it knows), requests apply in sequence, a gap is
// refused so the bridge starts over, and a session nobody renews within its ttl ends with
// its pools emptied: an engine the manager cannot hear has nothing cached, as far as
// routing is concerned.
//
// Thread-safe. One mutex serialises publishes (they are applied to the index under it, in
// order); the index has its own lock and never calls back.
#ifndef KVCM_SERVER_CORE_ENGINE_SESSIONS_H_
#define KVCM_SERVER_CORE_ENGINE_SESSIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/page_hash.h"
#include "common/types.h"
#include "server/core/cache_index.h"
#include "server/core/clock.h"

namespace kvcm {

// Longest ttl a session may ask for.
inline constexpr absl::Duration kMaxEngineSessionTtl = absl::Minutes(10);

struct EngineChange {
  enum class Kind : uint8_t { kStored = 1, kRemoved = 2, kCleared = 3 };
  Kind kind = Kind::kStored;
  Tier tier = Tier::kGpu;
  // kStored: a chain held whole; kRemoved: a chain whose last page (and everything under it)
  // left; kCleared: empty.
  std::vector<PageHash> pages;
};

struct EnginePublish {
  std::string engine_id;
  NamespaceId ns;
  uint64_t session = 0;   // non-zero
  uint64_t sequence = 0;  // >= 1
  std::vector<EngineChange> changes;
  absl::Duration ttl = absl::ZeroDuration();  // 0: the default
  bool close = false;
};

struct EnginePublishResult {
  uint64_t stored_pages = 0;
  uint64_t removed_pages = 0;
  uint64_t pages = 0;  // in the engine's pools after the request
  bool duplicate = false;
  bool new_session = false;
};

struct EngineSessionInfo {
  std::string engine_id;
  NamespaceId ns;
  uint64_t session = 0;
  uint64_t sequence = 0;
  absl::Time last_publish;
  absl::Duration ttl;
  uint64_t pages = 0;
};

// Totals since start, for /metrics.
struct EngineCounts {
  uint64_t live = 0;              // sessions now
  uint64_t started = 0;           // sessions begun (sequence 1)
  uint64_t lapsed = 0;            // ended by ExpireIdle
  uint64_t stored_pages = 0;      // page-locations changes added
  uint64_t removed_pages = 0;     // page-locations changes removed (clears included)
  uint64_t refused_sequence = 0;  // requests refused for their session or sequence
};

class EngineSessions {
 public:
  // Not owned; both must outlive this. REQUIRES: 0 < default_ttl <= kMaxEngineSessionTtl.
  EngineSessions(CacheIndex* index, Clock* clock, absl::Duration default_ttl);

  // Applies one request (see CacheManager.PublishEngineEvents). FAILED_PRECONDITION naming
  // "sequence" for an unknown session past sequence 1 or a gap; INVALID_ARGUMENT naming the
  // namespace when a session changes it; the index's errors (unknown namespace, a pool
  // that is an agent's) before anything changes. An error while applying changes[i] (the
  // namespace was deleted meanwhile) ends the session, its pools emptied, and names it.
  absl::StatusOr<EnginePublishResult> Publish(const EnginePublish& request)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Ends every session whose last request is older than its ttl; returns them.
  std::vector<EngineSessionInfo> ExpireIdle() ABSL_LOCKS_EXCLUDED(mu_);

  // Whether `engine_id` has a live session.
  bool IsLive(absl::string_view engine_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // Every live session, by engine id.
  std::vector<EngineSessionInfo> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);

  EngineCounts Counts() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Session {
    NamespaceId ns;
    uint64_t session = 0;
    uint64_t sequence = 0;
    absl::Time last_publish;
    absl::Duration ttl;
  };

  // Empties every pool of `engine_id` in the session's namespace.
  void ClearPools(const std::string& engine_id, const Session& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t PagesOf(const std::string& engine_id) const;
  EngineSessionInfo InfoOf(const std::string& engine_id, const Session& s) const;

  CacheIndex* const index_;
  Clock* const clock_;
  const absl::Duration default_ttl_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  EngineCounts counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_SERVER_CORE_ENGINE_SESSIONS_H_
