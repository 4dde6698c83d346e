// LinkCache: an agent's BlockLinks (block_link.h), created lazily per peer and cached, the
// logic of the NCCL transport's communicator cache without NCCL in it (so that it is tested
// on any CPU with in-memory links).
//
// Two kinds of links, each bounded by max_links:
//   pull links    this agent made them (NcclBootstrap, rank 0) to pull from the agent serving
//                 at a data address; keyed by that address.
//   served links  another agent offered them (NcclConnect, rank 1) to pull from this one;
//                 keyed by (the puller's agent id, its link id).
// A transfer leases a link exclusively, so transfers over one link run one at a time and in
// the same order on both ends. A lease marked broken drops its link (destroying it aborts
// the communicator), so the next pull bootstraps a new one. When a new link would exceed
// max_links, the least recently used idle link is dropped; with none idle the new one is
// refused (RESOURCE_EXHAUSTED). A new served link of a puller drops that puller's idle older
// links: a puller uses only its newest link to an agent.
//
// Thread-safe. Link creation (the connector, a served link's join) runs outside the lock:
// pulls wait for a link being connected rather than connect it twice.
#ifndef KVCM_GPU_AGENT_TRANSPORT_LINK_CACHE_H_
#define KVCM_GPU_AGENT_TRANSPORT_LINK_CACHE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpu/agent/transport/block_link.h"
#include "gpu/agent/transport/transport.h"

namespace kvcm {

struct LinkCacheOptions {
  // Most pull links, and most served links, held at once. >= 1.
  uint32_t max_links = 16;
};

// OK for an offer a transport may join: a valid from_agent_id, link_id != 0, a 128-byte
// unique_id, nranks 2 and ranks {0, 1} with `rank` this agent's; INVALID_ARGUMENT naming the
// field otherwise.
absl::Status ValidateLinkOffer(const LinkOffer& offer);

class LinkCache {
 public:
  // Makes a link; `stop` turns true when the cache is shutting down (give up soon).
  using LinkMaker =
      std::function<absl::StatusOr<std::unique_ptr<BlockLink>>(const std::atomic<bool>& stop)>;
  // Makes a pull link named `link_id` to `peer_agent_id` (bootstrap, join, warm-up).
  using Connector = std::function<absl::StatusOr<std::unique_ptr<BlockLink>>(
      const std::string& peer_agent_id, uint64_t link_id, const std::atomic<bool>& stop)>;

  // Exclusive use of one link for one transfer; gives the link back when destroyed.
  class Lease {
   public:
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) = delete;
    Lease(const Lease&) = delete;
    ~Lease();
    BlockLink& link() const { return *link_; }
    uint64_t link_id() const { return link_id_; }
    const std::string& peer_agent_id() const { return peer_agent_id_; }
    // The link failed: it is dropped when the lease ends.
    void MarkBroken() { broken_ = true; }

   private:
    friend class LinkCache;
    Lease(LinkCache* cache, bool pull, std::string key, uint64_t link_id, std::string peer_agent_id,
          BlockLink* link)
        : cache_(cache),
          pull_(pull),
          key_(std::move(key)),
          link_id_(link_id),
          peer_agent_id_(std::move(peer_agent_id)),
          link_(link) {}
    LinkCache* cache_;
    bool pull_;
    std::string key_;  // the pull link's address, or the served link's puller
    uint64_t link_id_;
    std::string peer_agent_id_;
    BlockLink* link_;
    bool broken_ = false;
  };

  // `connect` makes pull links. REQUIRES: options.max_links >= 1.
  LinkCache(LinkCacheOptions options, Connector connect);
  // Cancels every link and joins the threads of served links being joined.
  // REQUIRES: no lease is held.
  ~LinkCache();
  LinkCache(const LinkCache&) = delete;
  LinkCache& operator=(const LinkCache&) = delete;

  // The pull link to the agent serving at `peer_address`, waiting up to `wait` while another
  // transfer holds it or it is being connected. NOT_FOUND when there is none;
  // DEADLINE_EXCEEDED when the wait ran out; CANCELLED after CancelAll.
  absl::StatusOr<Lease> LeasePull(const std::string& peer_address, absl::Duration wait)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A pull link to `peer_agent_id`, serving at `peer_address`, that is not `stale_link_id`
  // (a link the server did not know; 0: none): the cached one if another pull already
  // replaced the stale one, else a new one from the connector, made on this thread, which
  // replaces the stale one. The connector's error; RESOURCE_EXHAUSTED when max_links links
  // are in use; DEADLINE_EXCEEDED / CANCELLED as LeasePull.
  absl::StatusOr<Lease> ConnectPull(const std::string& peer_address,
                                    const std::string& peer_agent_id, uint64_t stale_link_id,
                                    absl::Duration wait) ABSL_LOCKS_EXCLUDED(mu_);

  // Agent `puller` offered link `link_id`: runs `join` on a thread of the cache, and serves
  // the link once it returns one. Drops the puller's idle older links. ALREADY_EXISTS for a
  // link known already, RESOURCE_EXHAUSTED when max_links served links are in use,
  // CANCELLED after CancelAll; `join` is not run then.
  absl::Status OfferServed(const std::string& puller, uint64_t link_id, LinkMaker join)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The served link (`puller`, `link_id`), waiting up to `wait` while it is being joined or
  // another transfer holds it. NOT_FOUND when it is unknown (never offered, failed to join,
  // or dropped); DEADLINE_EXCEEDED / CANCELLED as LeasePull.
  absl::StatusOr<Lease> LeaseServed(const std::string& puller, uint64_t link_id,
                                    absl::Duration wait) ABSL_LOCKS_EXCLUDED(mu_);

  // Cancels every link (transfers in progress end with CANCELLED) and refuses new leases.
  void CancelAll() ABSL_LOCKS_EXCLUDED(mu_);

  // Links held now (connected or being connected).
  size_t pull_links() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t served_links() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    uint64_t link_id = 0;
    std::string peer_agent_id;
    std::unique_ptr<BlockLink> link;  // null while connecting
    bool leased = false;
    uint64_t last_used = 0;
  };
  using ServedKey = std::pair<std::string, uint64_t>;
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };

  // Waits up to `wait` until `find()` is absent, or present with a link and not leased.
  // Returns the entry then (null when absent); DEADLINE_EXCEEDED / CANCELLED.
  template <typename Find>
  absl::StatusOr<Entry*> AwaitIdle(Find find, absl::Duration wait)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes room for one more entry in `map` (dropping its least recently used idle link
  // into `dropped`); RESOURCE_EXHAUSTED when every entry is busy.
  template <typename Map>
  absl::Status MakeRoom(Map& map, std::list<std::unique_ptr<BlockLink>>& dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(Lease& lease) ABSL_LOCKS_EXCLUDED(mu_);
  void JoinFinishedWorkers() ABSL_LOCKS_EXCLUDED(mu_);

  const LinkCacheOptions options_;
  const Connector connect_;
  std::atomic<bool> stop_{false};

  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Entry> pull_ ABSL_GUARDED_BY(mu_);
  std::map<ServedKey, Entry> served_ ABSL_GUARDED_BY(mu_);
  std::list<Worker> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_LINK_CACHE_H_
