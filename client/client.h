// kvcm::Client: the C++ client of the kvcm-manager's CacheManager service, for inference
// workers, routers and tools.
//
// Every call returns absl::Status / absl::StatusOr with the server's gRPC code and message,
// runs under a deadline (ClientOptions::default_deadline_ms unless CallOptions says
// otherwise) and is retried with exponential backoff and jitter only when the answer is
// UNAVAILABLE, at most ClientOptions::max_attempts times (non_idempotent_max_attempts for
// the calls the proto does not mark idempotent, e.g. Reserve, Unreserve, Evict*;
// RetriesFully) and never past the deadline. The defaults ride out a manager takeover
// (etcd lease ttl 5 s plus an election). An UNAVAILABLE whose text suggests a TLS/plaintext
// mismatch gets a line naming the likely fix (client/tls_hint.h).
// A retried call whose first reply was lost in transit may run twice on the manager: Insert
// is idempotent, a duplicated pin lapses with its lease, and a retried Release may answer
// NOT_FOUND after the first one succeeded.
//
// Prompts travel as page hashes when this client registered the namespace (RegisterModel
// caches the namespace's hash key and page size and hashes locally with kvcm::HashPages),
// and as tokens otherwise (the manager hashes them). Both give the same match.
//
// Result types are named *Reply (and MatchParams) so that they never collide with the core's
// MatchResult / MatchOptions when a program links both, as tests and the manager do.
#ifndef KVCM_CLIENT_CLIENT_H_
#define KVCM_CLIENT_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model_spec.h"
#include "common/page_hash.h"
#include "common/security_options.h"
#include "common/types.h"

namespace google::protobuf {
class Message;
class MethodDescriptor;
}  // namespace google::protobuf

namespace grpc {
class ClientContext;
class Status;
}  // namespace grpc

namespace kvcm {

class ChannelFactory;

namespace v1 {
class Prompt;
}  // namespace v1

// One pool (agent, tier); the client's name for the core's PoolKey.
using PoolRef = PoolKey;

// Whether Client retries a call of `method` for max_attempts: its proto marks it safe to
// repeat (idempotency_level IDEMPOTENT or NO_SIDE_EFFECTS). Any other gets
// non_idempotent_max_attempts.
bool RetriesFully(const google::protobuf::MethodDescriptor& method);

struct ClientOptions {
  // Manager address, "host:port" or any gRPC target ("dns:///kvcm:50051").
  std::string address = "127.0.0.1:50051";
  // Deadline of a call, including all its retries, when CallOptions gives none. > 0.
  // With the retry defaults below it outlasts a manager takeover: the deployed leader lease
  // (deploy/k8s etcd_lease_ttl_s = 5) plus an election.
  int64_t default_deadline_ms = 10000;
  // Attempts per idempotent call, the first included: 1 disables retries. 1..100.
  int max_attempts = 30;
  // Backoff before the first retry; also the channel's initial reconnect backoff, so that a
  // retry does not find the channel still waiting out gRPC's default 1 s backoff. > 0.
  int64_t initial_backoff_ms = 100;
  // Longest backoff between two attempts (and between two reconnects). >= initial.
  int64_t max_backoff_ms = 2000;
  // Growth of the backoff per retry. >= 1.
  double backoff_multiplier = 2.0;
  // Attempts per call that is not idempotent (no idempotency_level in the proto, e.g.
  // Reserve, Unreserve, EvictFromPool, EvictFromNamespace: a repeat takes more bytes), at
  // most max_attempts. 1..100.
  int non_idempotent_max_attempts = 5;

  // Transport security (common/credentials.h): one of ca_file or insecure is required.
  // ca_file (PEM) verifies the manager, whose certificate must name the address's host;
  // cert_file and key_file (PEM, both or neither) are this client's certificate, which a
  // manager serving mutual TLS requires. The files are re-read every minute. insecure = true
  // speaks plaintext, for development on a trusted machine, and excludes the files.
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  bool insecure = false;
  // Bearer token sent as "authorization: Bearer <token>" with every call, streams included
  // (and with BlockAgent calls on channels()); empty sends none. Visible ASCII, no spaces.
  // Take it from a file or the environment: a command line is visible to every user (ps).
  std::string token;

  // The transport security above as the credentials factory takes it.
  TlsOptions Tls() const;

  // INVALID_ARGUMENT naming the first bad field.
  absl::Status Validate() const;
};

// Per-call overrides.
struct CallOptions {
  // Deadline of this call including retries; <= 0 uses ClientOptions::default_deadline_ms.
  int64_t deadline_ms = 0;
  // When set, receives a copy of the call's successful reply message, for tools that print
  // it whole (kvcmctl --json). REQUIRES: the RPC's response type (kvcm.v1.MatchResponse for
  // Match, MatchHashes and MatchAndPin; InsertResponse for Insert; ...).
  google::protobuf::Message* reply = nullptr;
};

struct RegisterModelReply {
  ModelSpec spec;  // as stored by the manager (page size defaulted)
  uint64_t bytes_per_token = 0;
  uint64_t bytes_per_page = 0;
  // KeyFingerprint of the namespace's hash key (the key itself stays inside the client).
  uint64_t key_fingerprint = 0;
  bool created = false;  // false: the namespace already existed with this spec
  // The max page age in force for the namespace, seconds; 0: none.
  uint32_t max_page_age_s = 0;
};

struct RegisterModelParams {
  // Retention: seconds a cached page of the namespace may stay after it was committed
  // (kvcm.v1.RegisterModelRequest.max_page_age_s). 0: the manager's default. Only
  // tightens: a longer value than the namespace has leaves it unchanged.
  uint32_t max_page_age_s = 0;
};

struct MatchParams {
  // Agent the request will run on: its replicas come first and count in local_pages.
  std::string requester_agent_id;
  // Take a pin (with a lease) on the matched pages.
  bool pin = false;
  // Lease of the pin; 0 means the manager's default.
  uint32_t lease_ttl_ms = 0;
  // Look without touching anything (no recency, no pin, no counters). Excludes pin.
  bool probe = false;
};

struct MatchReply {
  struct Replica {
    PoolRef pool;
    std::vector<BlockId> block_ids;  // one per page of the segment, in prompt order
  };
  // A run of consecutive matched pages held by the same pools.
  struct Segment {
    uint32_t first_page = 0;
    uint32_t num_pages = 0;
    std::vector<Replica> replicas;  // the requester's agent first when it holds the run
  };
  uint32_t matched_pages = 0;   // leading whole pages cached somewhere
  uint32_t matched_tokens = 0;  // matched_pages * page size
  uint32_t prompt_pages = 0;    // whole pages in the prompt
  uint32_t local_pages = 0;     // leading pages on the requester's agent
  std::vector<Segment> segments;
  uint64_t pin_id = 0;  // 0 when no pin was taken
  absl::Time lease_expiry = absl::InfinitePast();
};

struct RouteParams {
  // How the manager orders the candidates (kvcm.v1.RoutePolicy).
  enum class Policy : uint8_t {
    kPrefillSaved = 1,   // most prefill saved, minus the queue's wait
    kRoundRobin = 2,     // the manager's Route counter
    kFirstPageHash = 3,  // the prompt's first page hash
    kLeastLoaded = 4,    // lowest load
  };
  struct Candidate {
    std::string agent_id;
    uint64_t load = 0;                   // any unit, the same for every candidate
    uint64_t queued_prefill_tokens = 0;  // waiting for or in prefill on the agent
  };
  // Agents to choose from; empty: every live agent.
  std::vector<Candidate> candidates;
  Policy policy = Policy::kPrefillSaved;
  // Prefill throughput of the model on one GPU, tokens/s; 0: the manager's default.
  double prefill_tokens_per_s = 0;
  // Change nothing (no recency, no pin, no counters). Excludes pin.
  bool probe = false;
  // Pin the matched pages for the chosen agent, as MatchParams::pin.
  bool pin = false;
  uint32_t lease_ttl_ms = 0;
};

// Policy by name: "prefill-saved", "round-robin", "hash-of-first-page", "least-loaded".
absl::StatusOr<RouteParams::Policy> ParseRouteParamsPolicy(absl::string_view name);

struct RouteReply {
  // What serving the prompt on one agent is expected to save (kvcm.v1.RankedAgent).
  struct Ranked {
    std::string agent_id;
    uint32_t cached_pages = 0;     // leading pages it holds
    uint32_t fetch_pages = 0;      // pages after those worth fetching from other agents
    uint32_t recompute_pages = 0;  // pages left to prefill
    double transfer_ms = 0;
    double saved_prefill_ms = 0;
    double link_gbps = 0;
    uint64_t load = 0;
    double queue_ms = 0;
  };
  std::vector<Ranked> ranked;  // best first
  // The prompt matched for ranked[0] (its replicas first; pinned when asked).
  MatchReply match;
};

struct InsertParams {
  // The agent epoch the blocks were allocated in (BlockAgent.Stats): ABORTED, nothing
  // changed, when the agent restarted since. 0: not checked.
  uint64_t agent_epoch = 0;
  // Take the new pages' bytes out of the headroom the namespace's tenant reserved in the
  // pool first.
  bool use_reservation = false;
};

struct InsertReply {
  uint32_t already_present_pages = 0;
  std::vector<BlockId> existing_block_ids;  // index's blocks of the already present pages
  uint32_t new_pages = 0;
  uint32_t replicated_pages = 0;
  uint64_t evicted_bytes = 0;
};

struct ReserveParams {
  // Whose headroom (kvcm.v1.ReserveRequest.tenant). Empty: a worker's own tenant, or for an
  // admin the operators' (no quota; no Insert takes it). An admin may name any tenant; a
  // worker only its own (PERMISSION_DENIED otherwise).
  std::string tenant;
};

struct EvictReply {
  uint64_t evicted_bytes = 0;
  uint64_t evicted_pages = 0;
};

struct DeleteNamespaceReply {
  uint64_t removed_pages = 0;  // page-locations removed (their blocks are freed on agents)
  uint64_t dropped_pins = 0;
};

struct ForgetAgentParams {
  // Forget the agent even when it is alive (FAILED_PRECONDITION otherwise).
  bool force = false;
};

struct ForgetAgentReply {
  uint64_t epoch = 0;      // the agent's registered epoch
  bool was_alive = false;  // only with force
  uint64_t dropped_pages = 0;
};

struct ManagerStats {
  struct Pool {
    PoolRef pool;
    uint64_t capacity_bytes = 0;
    uint64_t used_bytes = 0;
    uint64_t pinned_bytes = 0;
    uint64_t pages = 0;
    uint64_t reserved_bytes = 0;  // headroom for admitted work
    bool engine = false;          // an engine's pool (PublishEngineEvents); capacity 0
  };
  struct Namespace {
    NamespaceId ns;
    ModelSpec spec;
    uint64_t bytes_per_token = 0;
    uint64_t bytes_per_page = 0;
    uint64_t pages = 0;           // distinct pages
    uint64_t page_locations = 0;  // pages x replicas
    uint64_t radix_nodes = 0;
    uint32_t max_page_age_s = 0;  // retention limit in force; 0: none
    uint64_t expired_pages = 0;   // page-locations removed for their age
  };
  struct Counters {
    uint64_t match_requests = 0;
    uint64_t requested_pages = 0;
    uint64_t matched_pages = 0;
    uint64_t requested_tokens = 0;
    uint64_t matched_tokens = 0;
    uint64_t inserted_pages = 0;
    uint64_t evicted_pages = 0;
    uint64_t evicted_bytes = 0;
    uint64_t eviction_regret_pages = 0;
    uint64_t pins_taken = 0;
    uint64_t pins_released = 0;
    uint64_t lease_expiries = 0;
    uint64_t demoted_pages = 0;  // moved from a GPU pool to its agent's HOST pool
    uint64_t dropped_pages = 0;  // forgotten with a restarted or gone agent
    uint64_t expired_pages = 0;  // older than their namespace's max page age
  };
  struct Limits {
    uint32_t max_tokens_per_request = 0;
    uint32_t max_pages_per_request = 0;
    uint32_t max_lease_ttl_ms = 0;
    uint32_t default_lease_ttl_ms = 0;
  };
  // An agent registered through AgentControl.
  struct Agent {
    std::string agent_id;
    std::string device;  // "cuda:0", "host"
    Tier tier = Tier::kGpu;
    uint64_t epoch = 0;
    bool alive = false;  // false: no heartbeat within the manager's timeout
    uint64_t last_heartbeat_age_ms = 0;
    uint64_t used_bytes = 0;          // from the last heartbeat
    uint64_t free_blocks = 0;         // from the last heartbeat
    std::string block_agent_address;  // where it serves BlockAgent; may be empty
    std::string data_address;         // where peers pull its blocks; may be empty
  };
  std::vector<Pool> pools;
  std::vector<Namespace> namespaces;
  std::vector<Agent> agents;  // agent_id order
  // An engine whose prefix cache the manager mirrors (a live PublishEngineEvents session).
  struct Engine {
    std::string engine_id;
    NamespaceId ns;
    uint64_t session = 0;
    uint64_t sequence = 0;  // last applied
    uint64_t last_publish_age_ms = 0;
    uint64_t pages = 0;  // page-locations in its pools
  };
  std::vector<Engine> engines;  // engine_id order
  // Eviction policy "select"'s choice (PolicySelection in cache_manager.proto). Its hit rates
  // are those of miniature caches fed a sample of the pages, not the real pools'.
  struct Selection {
    struct Candidate {
      std::string name;
      double shadow_hit_rate = 0;  // 0..1, over a decaying window
    };
    std::string active;                 // the candidate the index evicts in the order of
    std::vector<Candidate> candidates;  // the policy table's order
    uint64_t switches = 0;              // moves of the choice since the manager started
    uint64_t sampled_lookup_pages = 0;  // GPU pools' looked-up pages in the sample
    uint64_t sampled_store_pages = 0;   // GPU pools' stored pages in the sample
    uint64_t shadow_pages = 0;          // page-locations all miniature caches hold
    uint32_t pools = 0;                 // GPU pools simulated
    double min_sample_rate = 0;         // 1: every page; 0 before the first prompt
  };
  Counters counters;
  uint64_t active_pins = 0;
  std::string policy;
  std::optional<Selection> selection;  // set only for policy "select"
  Limits limits;
};

// One index change seen by WatchEvents.
struct WatchedEvent {
  enum class Kind : uint8_t { kUnspecified = 0, kStored = 1, kRemoved = 2, kCleared = 3 };
  Kind kind = Kind::kUnspecified;
  // Why pages were removed (kRemoved); kUnspecified otherwise.
  enum class Reason : uint8_t { kUnspecified = 0, kEvicted = 1, kExpired = 2 };
  Reason reason = Reason::kUnspecified;
  NamespaceId ns;
  PoolRef pool;
  std::vector<PageHash> pages;
  uint64_t sequence = 0;  // +1 per event of this stream, from 1; a gap means events were lost
};

// What this client has done, for tests and client-side metrics. Monotonic.
struct ClientCounters {
  uint64_t calls = 0;     // unary calls started
  uint64_t attempts = 0;  // RPC attempts sent (calls + retries)
  uint64_t retries = 0;   // attempts after an UNAVAILABLE answer
};

class Client;

// A pin on a matched prefix, released when the object dies. Move-only; a moved-from object
// owns nothing and releases nothing. The Client must outlive it.
//
// Not thread-safe: one owner at a time (the Client it calls is thread-safe).
class PinnedPrefix {
 public:
  PinnedPrefix() = default;
  PinnedPrefix(PinnedPrefix&& other) noexcept;
  // Releases the pin this object holds (best effort) before taking other's.
  PinnedPrefix& operator=(PinnedPrefix&& other) noexcept;
  PinnedPrefix(const PinnedPrefix&) = delete;
  PinnedPrefix& operator=(const PinnedPrefix&) = delete;
  // Releases the pin, best effort, with a deadline of at most kReleaseDeadlineMs: if the
  // manager cannot be reached the lease lapses on its own.
  ~PinnedPrefix();

  static constexpr int64_t kReleaseDeadlineMs = 1000;

  // 0 when no pin is held (nothing matched, released, or moved from).
  uint64_t pin_id() const { return match_.pin_id; }
  const NamespaceId& ns() const { return ns_; }
  const MatchReply& match() const { return match_; }

  // Drops the pin now. Afterwards the object holds nothing, whatever the outcome (a pin the
  // manager did not hear about lapses with its lease). OK when nothing is held.
  absl::Status Release(const CallOptions& call = {});
  // Extends the lease to now + ttl_ms (0: the manager's default) and updates
  // match().lease_expiry. FAILED_PRECONDITION when no pin is held; ABORTED when the lease
  // already expired.
  absl::Status Renew(uint32_t ttl_ms, const CallOptions& call = {});

 private:
  friend class Client;
  PinnedPrefix(Client* client, NamespaceId ns, MatchReply match)
      : client_(client), ns_(std::move(ns)), match_(std::move(match)) {}
  void ReleaseQuietly();

  Client* client_ = nullptr;
  NamespaceId ns_;
  MatchReply match_;
};

// A WatchEvents subscription: a thread reads the stream and calls the callback per event.
// Destroying the handle cancels the stream and waits for the thread.
//
// Thread-safe: Cancel, Wait and the destructor may be called concurrently, from any thread
// but the callback's own.
class EventWatch {
 public:
  using Callback = std::function<void(const WatchedEvent&)>;
  ~EventWatch();
  EventWatch(const EventWatch&) = delete;
  EventWatch& operator=(const EventWatch&) = delete;

  // Ends the stream; the callback is not called after Cancel returns.
  void Cancel();
  // Blocks until the stream ends and returns how: CANCELLED after Cancel,
  // RESOURCE_EXHAUSTED when the manager dropped a slow subscriber, UNAVAILABLE when the
  // connection was lost.
  absl::Status Wait();

 private:
  friend class Client;
  EventWatch();

  void Join();

  std::unique_ptr<grpc::ClientContext> context_;
  std::thread thread_;
  std::once_flag join_once_;
  // Written by the reader thread before it ends; read only after joining it.
  absl::Status final_status_;
};

// Thread-safe: every method may be called concurrently from any number of threads.
class Client {
 public:
  // Creates the channel; does not wait for the manager (the first call connects, and is
  // retried while the manager is UNAVAILABLE; a refused TLS handshake is UNAVAILABLE too).
  // INVALID_ARGUMENT for bad options, and for TLS files that cannot be read or do not hold
  // what they should (naming the field and the path).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Creates or confirms namespace `ns` and caches its hash key and page size, so later
  // calls on `ns` hash prompts locally. A re-registration after a manager restart (see
  // SendPrompt) sends the same params again.
  absl::StatusOr<RegisterModelReply> RegisterModel(const NamespaceId& ns, const ModelSpec& spec,
                                                   const RegisterModelParams& params = {},
                                                   const CallOptions& call = {});

  // Whether this client holds the hash key of `ns` (RegisterModel succeeded on it).
  bool HashesLocally(const NamespaceId& ns) const;
  // Chained page hashes of `tokens` with the cached key of `ns` (trailing partial page
  // ignored). FAILED_PRECONDITION when RegisterModel was not called for `ns`.
  absl::StatusOr<std::vector<PageHash>> HashPrompt(const NamespaceId& ns,
                                                   std::span<const int32_t> tokens) const;

  // Longest cached prefix of `tokens`. Sends page hashes when the key of `ns` is cached and
  // tokens otherwise. If the manager refuses the hashes (FAILED_PRECONDITION: its secret
  // changed; NOT_FOUND: it restarted and forgot the namespace), re-registers with the cached
  // spec and tries once more, within the same deadline.
  absl::StatusOr<MatchReply> Match(const NamespaceId& ns, std::span<const int32_t> tokens,
                                   const MatchParams& params = {}, const CallOptions& call = {});
  // Same with page hashes the caller computed (HashPrompt). REQUIRES: RegisterModel on ns.
  absl::StatusOr<MatchReply> MatchHashes(const NamespaceId& ns, std::span<const PageHash> pages,
                                         const MatchParams& params = {},
                                         const CallOptions& call = {});
  // Match with pin = true, wrapped so the pin is released when the result dies.
  // params.pin is forced on, and params.probe must be false.
  absl::StatusOr<PinnedPrefix> MatchAndPin(const NamespaceId& ns, std::span<const int32_t> tokens,
                                           MatchParams params = {}, const CallOptions& call = {});

  // Which agent should serve `tokens`: every candidate ranked by expected prefill saved
  // (or by a cache-blind policy), and the match for the best one. Hashes locally and
  // re-registers a stale key like Match.
  absl::StatusOr<RouteReply> Route(const NamespaceId& ns, std::span<const int32_t> tokens,
                                   const RouteParams& params = {}, const CallOptions& call = {});

  // Records that `pool` holds the whole pages of `tokens` in blocks `block_ids` (exactly one
  // per whole page, distinct). Hashes locally when it can, like Match. In an agent's pool the
  // blocks must be allocated to `ns` with the agent's epoch as owner (BlockAgent.Allocate):
  // the agent commits them before the index takes the pages (see CacheManager.Insert).
  absl::StatusOr<InsertReply> Insert(const NamespaceId& ns, std::span<const int32_t> tokens,
                                     const PoolRef& pool, std::span<const BlockId> block_ids,
                                     const CallOptions& call = {});
  absl::StatusOr<InsertReply> Insert(const NamespaceId& ns, std::span<const int32_t> tokens,
                                     const PoolRef& pool, std::span<const BlockId> block_ids,
                                     const InsertParams& params, const CallOptions& call = {});
  absl::StatusOr<InsertReply> InsertHashes(const NamespaceId& ns, std::span<const PageHash> pages,
                                           const PoolRef& pool, std::span<const BlockId> block_ids,
                                           const CallOptions& call = {});
  absl::StatusOr<InsertReply> InsertHashes(const NamespaceId& ns, std::span<const PageHash> pages,
                                           const PoolRef& pool, std::span<const BlockId> block_ids,
                                           const InsertParams& params,
                                           const CallOptions& call = {});

  // NOT_FOUND for an unknown pin, ABORTED for one whose lease expired.
  absl::Status Release(const NamespaceId& ns, uint64_t pin_id, const CallOptions& call = {});
  // New lease expiry. ttl_ms 0: the manager's default.
  absl::StatusOr<absl::Time> RenewLease(const NamespaceId& ns, uint64_t pin_id, uint32_t ttl_ms,
                                        const CallOptions& call = {});

  // Evicts at least `bytes` of unpinned pages (all or nothing; see EvictRequest).
  // Headroom for admitted work: makes `bytes` of `pool` free (evicting exactly the
  // shortfall) and holds them; returns the bytes evicted. Unreserve gives them back. The
  // headroom is the caller's tenant's (a worker's own; an admin's is the operators', which
  // no Insert takes) and counts against the manager's tenant_max_bytes.
  absl::StatusOr<uint64_t> Reserve(const PoolRef& pool, uint64_t bytes,
                                   const CallOptions& call = {});
  absl::Status Unreserve(const PoolRef& pool, uint64_t bytes, const CallOptions& call = {});
  // The same for the tenant `params` names (an admin's call; see ReserveParams).
  absl::StatusOr<uint64_t> Reserve(const PoolRef& pool, uint64_t bytes, const ReserveParams& params,
                                   const CallOptions& call = {});
  absl::Status Unreserve(const PoolRef& pool, uint64_t bytes, const ReserveParams& params,
                         const CallOptions& call = {});

  absl::StatusOr<EvictReply> EvictFromPool(const PoolRef& pool, uint64_t bytes,
                                           const CallOptions& call = {});
  absl::StatusOr<EvictReply> EvictFromNamespace(const NamespaceId& ns, uint64_t bytes,
                                                const CallOptions& call = {});

  // Operator (role admin): removes a namespace with its pages and pins.
  absl::StatusOr<DeleteNamespaceReply> DeleteNamespace(const NamespaceId& ns,
                                                       const CallOptions& call = {});
  // Operator (role admin): forgets an agent that is gone now, instead of after the
  // manager's gone_agent_memory_s (kvcm.v1.CacheManager.ForgetAgent).
  absl::StatusOr<ForgetAgentReply> ForgetAgent(const std::string& agent_id,
                                               const ForgetAgentParams& params = {},
                                               const CallOptions& call = {});

  absl::StatusOr<ManagerStats> Stats(const CallOptions& call = {});

  // Subscribes to index changes of `ns` (all namespaces when nullopt). `callback` runs on the
  // subscription's own thread, one event at a time; it must not destroy the handle. The
  // stream has no deadline and is not retried: after Wait() returns, subscribe again.
  // The Client must outlive the handle.
  std::unique_ptr<EventWatch> WatchEvents(const std::optional<NamespaceId>& ns,
                                          EventWatch::Callback callback);

  ClientCounters counters() const;
  const ClientOptions& options() const { return options_; }
  // Opens channels with this client's credentials and token, e.g. to an agent's BlockAgent
  // (common/credentials.h).
  const ChannelFactory& channels() const;

 private:
  struct NamespaceKey {
    HashKey key;
    uint64_t fingerprint = 0;  // KeyFingerprint(key)
    uint32_t page_size_tokens = 0;
    ModelSpec spec;              // as sent to RegisterModel; re-sent to refresh a stale key
    RegisterModelParams params;  // likewise
  };

  // The channel and the generated stub (kept out of this header).
  struct Rpc;

  Client(ClientOptions options, std::unique_ptr<Rpc> rpc);

  // Absolute deadline of a call started now.
  absl::Time DeadlineOf(const CallOptions& call) const;
  // Runs `attempt`, a call of `method`, until `deadline`, retrying UNAVAILABLE with backoff
  // (at most max_attempts times, or non_idempotent_max_attempts unless RetriesFully(method)),
  // and converts the final grpc::Status. `attempt` gets a fresh context per try with the
  // deadline set.
  absl::Status Invoke(const google::protobuf::MethodDescriptor& method, absl::Time deadline,
                      absl::FunctionRef<grpc::Status(grpc::ClientContext*)> attempt);

  // reply_copy: CallOptions::reply.
  absl::StatusOr<RegisterModelReply> RegisterModelUntil(
      const NamespaceId& ns, const ModelSpec& spec, const RegisterModelParams& params,
      absl::Time deadline, google::protobuf::Message* reply_copy = nullptr);
  std::optional<NamespaceKey> CachedKey(const NamespaceId& ns) const;
  // The cached key, or FAILED_PRECONDITION when RegisterModel was not called for `ns`.
  absl::StatusOr<NamespaceKey> RequireKey(const NamespaceId& ns) const;
  // Page hashes of `tokens` under `key`, or the tokens themselves when there is no key.
  static void FillPrompt(const std::optional<NamespaceKey>& key, std::span<const int32_t> tokens,
                         v1::Prompt* prompt);
  // Runs `send` with the cached key of `ns` (hash locally) or nullopt (send tokens). When
  // hashes are refused because the manager changed its secret (FAILED_PRECONDITION) or
  // forgot the namespace (NOT_FOUND, a restart), re-registers with the cached spec and
  // sends once more.
  absl::Status SendPrompt(const NamespaceId& ns, absl::Time deadline,
                          absl::FunctionRef<absl::Status(const std::optional<NamespaceKey>&)> send);

  const ClientOptions options_;
  const std::unique_ptr<Rpc> rpc_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<NamespaceId, NamespaceKey> keys_ ABSL_GUARDED_BY(mu_);

  std::atomic<uint64_t> calls_{0};
  std::atomic<uint64_t> attempts_{0};
  std::atomic<uint64_t> retries_{0};
};

}  // namespace kvcm

#endif  // KVCM_CLIENT_CLIENT_H_
