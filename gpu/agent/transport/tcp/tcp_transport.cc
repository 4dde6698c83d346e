#include "gpu/agent/transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <list>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "gpu/agent/transport/block_stream.h"
#include "gpu/agent/transport/data_socket.h"
#include "gpu/agent/transport/link_transfer.h"
#include "gpu/agent/transport/tcp/handshake_budget.h"
#include "kvcm/v1/agent.pb.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

constexpr size_t kHashBytes = 16;

class TcpTransport final : public Transport {
 public:
  TcpTransport(TcpTransportOptions options, AgentPools pools, Tier main_tier, int listen_fd,
               std::string address, std::optional<LinkPort> links)
      : options_(std::move(options)),
        pools_(pools),
        main_tier_(main_tier),
        listen_fd_(listen_fd),
        address_(std::move(address)),
        links_(std::move(links)),
        io_timeout_(absl::Milliseconds(options_.io_timeout_ms)),
        counters_(options_.counters != nullptr ? options_.counters
                                               : std::make_shared<DataPortCounters>()),
        handshakes_(options_.max_handshakes, options_.max_handshakes_per_peer) {
    acceptor_ = std::thread([this] { AcceptLoop(); });
    watchdog_ = std::thread([this] { WatchRequests(); });
  }

  ~TcpTransport() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      for (int fd : open_fds_) shutdown(fd, SHUT_RDWR);  // wakes blocked sends and recvs
    }
    if (links_.has_value()) links_->links->CancelAll();  // wakes link sends and recvs
    shutdown(listen_fd_, SHUT_RDWR);
    acceptor_.join();
    watchdog_.join();
    close(listen_fd_);
    std::list<Worker> workers;
    {
      absl::MutexLock lock(&mu_);
      workers.swap(workers_);
    }
    for (Worker& w : workers) w.thread.join();
  }

  std::string address() const override { return address_; }

  void Pull(PullSpec spec, PullDone done) override {
    Spawn([this, spec = std::move(spec), done = std::move(done)]() mutable {
      const absl::Time start = absl::Now();
      absl::StatusOr<uint64_t> bytes = RunPull(spec);
      if (!bytes.ok()) {
        done(bytes.status());
        return;
      }
      done(TransferStats{.bytes = *bytes, .elapsed = absl::Now() - start});
    });
  }

 private:
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };

  // Runs `fn` on a new thread, after joining the threads that have finished.
  void Spawn(std::function<void()> fn) {
    std::list<Worker> finished;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = workers_.begin(); it != workers_.end();) {
        auto next = std::next(it);
        if (it->finished->load()) finished.splice(finished.end(), workers_, it);
        it = next;
      }
      auto flag = std::make_shared<std::atomic<bool>>(false);
      workers_.push_back(Worker{std::thread([fn = std::move(fn), flag] {
                                  fn();
                                  flag->store(true);
                                }),
                                flag});
    }
    for (Worker& w : finished) w.thread.join();
  }

  // Registers `fd` for cancellation; false when the transport is stopping.
  bool Track(int fd) {
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
    open_fds_.insert(fd);
    return true;
  }
  void Untrack(int fd) {
    {
      absl::MutexLock lock(&mu_);
      open_fds_.erase(fd);
      request_deadlines_.erase(fd);
    }
    close(fd);
  }

  // The request of served connection `fd` has arrived: its request deadline no longer runs.
  void RequestArrived(int fd) {
    absl::MutexLock lock(&mu_);
    request_deadlines_.erase(fd);
  }

  // Shuts down connections whose handshake or request has not arrived by its deadline (the
  // serving thread then fails its handshake or read, and frees what it held).
  void WatchRequests() {
    constexpr absl::Duration kTick = absl::Milliseconds(50);
    absl::MutexLock lock(&mu_);
    while (!stopping_) {
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), kTick);
      const absl::Time now = absl::Now();
      for (int fd : handshakes_.TakeExpired(now)) {
        counters_->handshake_timeouts.fetch_add(1, std::memory_order_relaxed);
        shutdown(fd, SHUT_RDWR);
      }
      for (auto it = request_deadlines_.begin(); it != request_deadlines_.end();) {
        if (it->second <= now) {
          shutdown(it->first, SHUT_RDWR);
          request_deadlines_.erase(it++);
        } else {
          ++it;
        }
      }
    }
  }

  // A connection from `peer` is pending until its handshake completes (HandshakeBudget):
  // closed at once when the budget refuses it, served on a new thread otherwise.
  void Admit(int fd, const sockaddr_in& peer) {
    const uint32_t ip = peer.sin_addr.s_addr;
    counters_->accepted.fetch_add(1, std::memory_order_relaxed);
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) {
        close(fd);
        return;
      }
      const absl::Time now = absl::Now();
      const HandshakeBudget::Admission admission =
          handshakes_.Admit(fd, ip, now + absl::Milliseconds(options_.handshake_timeout_ms));
      if (admission.verdict != HandshakeBudget::Verdict::kAdmitted) {
        close(fd);
        const bool per_peer = admission.verdict == HandshakeBudget::Verdict::kRefusedPerPeer;
        (per_peer ? counters_->refused_max_handshakes_per_peer : counters_->refused_max_handshakes)
            .fetch_add(1, std::memory_order_relaxed);
        LogRefusal(peer.sin_addr, per_peer ? "max_handshakes_per_peer" : "max_handshakes");
        return;
      }
      if (admission.evicted >= 0) {
        counters_->handshakes_evicted.fetch_add(1, std::memory_order_relaxed);
        shutdown(admission.evicted, SHUT_RDWR);  // its thread fails the handshake and closes it
      }
      open_fds_.insert(fd);
      request_deadlines_[fd] = now + absl::Milliseconds(options_.request_timeout_ms);
    }
    Spawn([this, fd, ip] {
      SetSocketOptions(fd, options_.io_timeout_ms);
      const bool served = ServeConnection(fd);
      {
        // Before the fd is closed: the budget and the watchdog must not name a reused one.
        absl::MutexLock lock(&mu_);
        (void)handshakes_.Remove(fd);
        if (served) {
          --serving_;
          if (--per_peer_[ip] == 0) per_peer_.erase(ip);
        }
      }
      Untrack(fd);
    });
  }

  void LogRefusal(in_addr address, absl::string_view cap) {
    char host[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &address, host, sizeof(host));
    refusals_.Log(LogSeverity::kWarning, absl::StrCat("data port: closed a connection from ", host,
                                                      " at once: data_", cap, " reached"));
  }

  // Pending connection `fd` from `ip` completed its handshake: it leaves the handshake
  // budget and takes a served slot. False when it has none (closed over max_connections or
  // max_connections_per_peer) or was displaced or timed out meanwhile.
  bool TakeSlot(int fd, uint32_t ip) {
    absl::MutexLock lock(&mu_);
    if (!handshakes_.Remove(fd)) return false;
    auto it = per_peer_.find(ip);
    const uint32_t from_peer = it == per_peer_.end() ? 0 : it->second;
    const bool over_total = serving_ >= options_.max_connections;
    if (over_total || from_peer >= options_.max_connections_per_peer) {
      (over_total ? counters_->refused_max_connections
                  : counters_->refused_max_connections_per_peer)
          .fetch_add(1, std::memory_order_relaxed);
      in_addr address{};
      address.s_addr = ip;
      LogRefusal(address, over_total ? "max_connections" : "max_connections_per_peer");
      return false;
    }
    ++serving_;
    ++per_peer_[ip];
    counters_->served.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // Whether `fd` is still pending; its handshake then failed by itself, and it leaves the
  // budget now (not when its thread ends).
  bool HandshakeFailed(int fd) {
    absl::MutexLock lock(&mu_);
    if (!handshakes_.Remove(fd)) return false;
    counters_->handshakes_failed.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  void AcceptLoop() {
    while (true) {
      sockaddr_in peer{};
      socklen_t len = sizeof(peer);
      // accept, not accept4: the latter is the gRPC port's guarded one (server_limits.h).
      const int fd = accept(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &len);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of fds for now: a later try may find some (the listener must not end here).
          absl::SleepFor(absl::Milliseconds(10));
          absl::MutexLock lock(&mu_);
          if (stopping_) return;
          continue;
        }
        return;  // the listener was shut down
      }
      Admit(fd, peer);
    }
  }

  // The connection over `fd`: plaintext, or TLS after the handshake as the server (when
  // `accepted`) or the client.
  absl::StatusOr<DataConn> Open(int fd, bool accepted) {
    if (options_.tls == nullptr) return DataConn(fd);
    return accepted ? options_.tls->Accept(fd) : options_.tls->Connect(fd);
  }

  // One accepted connection: its handshake (TLS: the handshake; plaintext: the request
  // frame) while pending, then, with a slot, the pull. True when it took a slot.
  bool ServeConnection(int fd) {
    sockaddr_in peer{};  // named in the log; asked before a refused peer can hang up
    socklen_t len = sizeof(peer);
    (void)getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len);
    const uint32_t ip = peer.sin_addr.s_addr;
    absl::StatusOr<DataConn> conn = Open(fd, /*accepted=*/true);
    if (!conn.ok()) {
      if (HandshakeFailed(fd)) {  // not one displaced or timed out by the data port itself
        char host[INET_ADDRSTRLEN] = "?";
        inet_ntop(AF_INET, &peer.sin_addr, host, sizeof(host));
        refusals_.Log(LogSeverity::kWarning,
                      absl::StrCat("data port: refused a connection from ", host, ":",
                                   ntohs(peer.sin_port), ": ", conn.status().ToString()));
      }
      return false;
    }
    const bool tls = conn->ssl() != nullptr;
    if (tls && !TakeSlot(fd, ip)) return false;
    v1::PullBlocksRequest req;
    if (!RecvFrame(*conn, &req).ok()) {
      if (!tls) (void)HandshakeFailed(fd);
      return tls;
    }
    RequestArrived(fd);
    if (!tls && !TakeSlot(fd, ip)) return false;
    Serve(*conn, req);
    return true;
  }

  // One served pull: the request, the header, then every block or an error.
  void Serve(DataConn& conn, const v1::PullBlocksRequest& req) {
    BlockPool* pool = pools_.ForWireTier(main_tier_, req.tier());
    const uint64_t block_bytes = pool != nullptr ? pool->geometry().bytes_per_block() : 0;
    const absl::StatusOr<NamespaceId> ns = CheckPullRequest(req, pool);
    const absl::Status check = ns.status();
    if (check.ok() && req.mode() == v1::PULL_MODE_NCCL && links_.has_value()) {
      ServeOverLink(conn, req, *pool, *ns);
      return;
    }
    if (!SendFrame(conn, HeaderOf(check, block_bytes)).ok() || !check.ok()) return;

    const std::vector<PageHash> pages = DecodePageHashes(req.page_hashes());
    if (CanSendInPlace(*pool)) {
      for (int i = 0; i < req.block_ids_size(); ++i) {
        bool answerable = false;
        absl::Status sent =
            SendCommittedBlockInPlace(conn, *pool, req.block_ids(i), *ns, pages[i],
                                      absl::StrCat("block_ids[", i, "]"), io_timeout_, &answerable);
        if (!sent.ok()) {
          if (answerable && SendAll(conn, &kTagError, 1).ok()) {
            (void)SendFrame(conn, HeaderOf(sent, block_bytes));
          }
          return;  // or the puller went away, or the block was freed mid-way: close
        }
      }
      return;
    }
    std::vector<std::byte> staging(block_bytes);
    for (int i = 0; i < req.block_ids_size(); ++i) {
      // The pool's lock is held for this copy only, never while the socket waits.
      absl::Status read = pool->ReadCommittedBlock(req.block_ids(i), *ns, pages[i], staging,
                                                   absl::StrCat("block_ids[", i, "]"));
      if (!read.ok()) {
        if (SendAll(conn, &kTagError, 1).ok()) (void)SendFrame(conn, HeaderOf(read, block_bytes));
        return;
      }
      if (!SendAll(conn, &kTagBlock, 1).ok() ||
          !SendAll(conn, staging.data(), staging.size()).ok()) {
        return;  // the puller went away
      }
    }
  }

  // A checked PULL_MODE_NCCL request: the header, then the blocks over the puller's link,
  // or link_needed when this agent does not know that link.
  void ServeOverLink(DataConn& conn, const v1::PullBlocksRequest& req, const BlockPool& pool,
                     const NamespaceId& ns) {
    const uint64_t block_bytes = pool.geometry().bytes_per_block();
    absl::StatusOr<LinkCache::Lease> lease =
        links_->links->LeaseServed(req.puller_agent_id(), req.link_id(), io_timeout_);
    if (!lease.ok()) {
      v1::PullBlocksHeader h = HeaderOf(lease.status(), block_bytes);
      if (absl::IsNotFound(lease.status())) {
        h = HeaderOf(absl::FailedPreconditionError(lease.status().message()), block_bytes);
        h.set_link_needed(true);
        h.set_agent_id(links_->agent_id);
      }
      (void)SendFrame(conn, h);
      return;
    }
    absl::StatusOr<uint32_t> chunk =
        LinkChunkBlocks(block_bytes, lease->link().staging_bytes(), req.link_chunk_bytes());
    if (!SendFrame(conn, HeaderOf(chunk.status(), block_bytes)).ok() || !chunk.ok()) return;
    const std::vector<PageHash> pages = DecodePageHashes(req.page_hashes());
    const std::vector<BlockId> ids(req.block_ids().begin(), req.block_ids().end());
    const LinkTransferResult served =
        kvcm::ServeOverLink(conn, pool, ns, ids, pages, *chunk, lease->link(), io_timeout_);
    if (served.link_broken) lease->MarkBroken();
  }

  absl::StatusOr<uint64_t> RunPull(const PullSpec& spec) {
    const size_t n = spec.peer_blocks.size();
    if (spec.dst == nullptr || n == 0 || spec.pages.size() != n || spec.dst_blocks.size() != n ||
        (!spec.dst_generations.empty() && spec.dst_generations.size() != n)) {
      return absl::InvalidArgumentError(
          "a pull needs a destination pool and one page and one destination block per peer "
          "block");
    }
    absl::StatusOr<sockaddr_in> peer = ParseAddress(spec.peer_address, "peer_address");
    if (!peer.ok()) return peer.status();
    if (!links_.has_value()) return PullOnce(*peer, spec, nullptr, nullptr);

    // The cached link to this peer, if any; a server that does not know it (or any) answers
    // link_needed with its agent id, and one new link is bootstrapped for a second try.
    std::optional<LinkCache::Lease> lease;
    if (absl::StatusOr<LinkCache::Lease> cached = links_->links->LeasePull(
            spec.peer_address, io_timeout_ + absl::Milliseconds(links_->connect_timeout_ms));
        cached.ok()) {
      lease.emplace(*std::move(cached));
    } else if (!absl::IsNotFound(cached.status())) {
      return cached.status();
    }
    for (int attempt = 0;; ++attempt) {
      std::string link_needed_by;
      absl::StatusOr<uint64_t> result =
          PullOnce(*peer, spec, lease.has_value() ? &*lease : nullptr, &link_needed_by);
      if (link_needed_by.empty()) return result;
      if (attempt > 0) {
        return absl::UnavailableError(absl::StrCat("peer ", spec.peer_address,
                                                   " does not know the link bootstrapped for it"));
      }
      const uint64_t stale = lease.has_value() ? lease->link_id() : 0;
      lease.reset();  // idle again: ConnectPull replaces it
      absl::StatusOr<LinkCache::Lease> fresh =
          links_->links->ConnectPull(spec.peer_address, link_needed_by, stale,
                                     io_timeout_ + absl::Milliseconds(links_->connect_timeout_ms));
      if (!fresh.ok()) {
        return absl::Status(fresh.status().code(),
                            absl::StrCat("NCCL link to ", link_needed_by, " at ", spec.peer_address,
                                         ": ", fresh.status().message()));
      }
      lease.emplace(*std::move(fresh));
    }
  }

  // One connection to `peer`: the request (over `lease`'s link when given), the header and
  // the blocks. A server that answers link_needed sets *link_needed_by to its agent id.
  absl::StatusOr<uint64_t> PullOnce(const sockaddr_in& peer, const PullSpec& spec,
                                    LinkCache::Lease* lease, std::string* link_needed_by) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Errno("socket");
    if (!Track(fd)) {
      close(fd);
      return absl::CancelledError("the transport is stopping");
    }
    absl::StatusOr<uint64_t> result = PullOn(fd, peer, spec, lease, link_needed_by);
    Untrack(fd);
    return result;
  }

  absl::StatusOr<uint64_t> PullOn(int fd, const sockaddr_in& peer, const PullSpec& spec,
                                  LinkCache::Lease* lease, std::string* link_needed_by) {
    SetSocketOptions(fd, options_.io_timeout_ms);
    if (connect(fd, reinterpret_cast<const sockaddr*>(&peer), sizeof(peer)) != 0) {
      return Errno(absl::StrCat("connect to ", spec.peer_address));
    }
    absl::StatusOr<DataConn> conn = Open(fd, /*accepted=*/false);
    if (!conn.ok()) {
      return absl::Status(conn.status().code(),
                          absl::StrCat(spec.peer_address, ": ", conn.status().message()));
    }
    v1::PullBlocksRequest req;
    req.set_tier(TierToProto(spec.peer_tier));
    NamespaceToProto(spec.ns, req.mutable_namespace_());
    req.mutable_block_ids()->Add(spec.peer_blocks.begin(), spec.peer_blocks.end());
    req.set_page_hashes(EncodePageHashes(spec.pages));
    if (links_.has_value()) {
      req.set_mode(v1::PULL_MODE_NCCL);
      req.set_puller_agent_id(links_->agent_id);
      if (lease != nullptr) {
        req.set_link_id(lease->link_id());
        req.set_link_chunk_bytes(lease->link().staging_bytes());
      }
    }
    if (absl::Status s = SendFrame(*conn, req); !s.ok()) return s;

    v1::PullBlocksHeader header;
    if (absl::Status s = RecvFrame(*conn, &header); !s.ok()) return s;
    if (header.link_needed() && links_.has_value() && !header.agent_id().empty()) {
      *link_needed_by = header.agent_id();
      // A server that asks for a link has failed this try, whatever code it sent.
      if (absl::Status s = StatusOf(header); !s.ok()) return s;
      return absl::FailedPreconditionError("peer: link needed");
    }
    if (absl::Status s = StatusOf(header); !s.ok()) return s;
    const uint64_t block_bytes = spec.dst->geometry().bytes_per_block();
    if (header.bytes_per_block() != block_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer blocks are ", header.bytes_per_block(), " bytes, ours ", block_bytes));
    }
    bool broken = false;
    absl::StatusOr<uint64_t> got = ReceiveBlocks(
        *conn, spec, lease != nullptr ? &lease->link() : nullptr, io_timeout_, &broken);
    if (broken) lease->MarkBroken();
    return got;
  }

  const TcpTransportOptions options_;
  const AgentPools pools_;
  const Tier main_tier_;
  const int listen_fd_;
  const std::string address_;
  const std::optional<LinkPort> links_;
  const absl::Duration io_timeout_;
  const std::shared_ptr<DataPortCounters> counters_;
  std::thread acceptor_;
  std::thread watchdog_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Accepted connections whose handshake has not completed.
  HandshakeBudget handshakes_ ABSL_GUARDED_BY(mu_);
  // Connections past their handshake, in all and by peer IPv4 address (network order).
  uint32_t serving_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint32_t, uint32_t> per_peer_ ABSL_GUARDED_BY(mu_);
  // Accepted connections whose request has not arrived yet: fd -> when it is closed.
  absl::flat_hash_map<int, absl::Time> request_deadlines_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int> open_fds_ ABSL_GUARDED_BY(mu_);
  // Refused handshakes: a scanner or a misconfigured peer must not flood the log.
  LogRateLimiter refusals_{10, absl::Minutes(1)};
  std::list<Worker> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<NamespaceId> CheckPullRequest(const v1::PullBlocksRequest& req,
                                             const BlockPool* pool) {
  absl::StatusOr<NamespaceId> ns =
      NamespaceFromProto(req.has_namespace_() ? &req.namespace_() : nullptr, "namespace");
  if (pool == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier ", static_cast<int>(req.tier()), " is not a pool of this agent"));
  }
  if (!ns.ok()) return ns.status();
  if (req.block_ids_size() == 0) return absl::InvalidArgumentError("block_ids is empty");
  if (req.page_hashes().size() != kHashBytes * req.block_ids_size()) {
    return absl::InvalidArgumentError("page_hashes must hold 16 bytes per block");
  }
  return ns;
}

absl::Status TcpTransportOptions::Validate() const {
  if (absl::StatusOr<sockaddr_in> a = ParseAddress(listen_address, "listen_address"); !a.ok()) {
    return a.status();
  }
  if (io_timeout_ms < 1) return absl::InvalidArgumentError("io_timeout_ms must be >= 1");
  if (max_connections < 1) return absl::InvalidArgumentError("max_connections must be >= 1");
  if (max_connections_per_peer < 1) {
    return absl::InvalidArgumentError("max_connections_per_peer must be >= 1");
  }
  if (max_handshakes < 1) return absl::InvalidArgumentError("max_handshakes must be >= 1");
  if (max_handshakes_per_peer < 1) {
    return absl::InvalidArgumentError("max_handshakes_per_peer must be >= 1");
  }
  if (handshake_timeout_ms < 1) {
    return absl::InvalidArgumentError("handshake_timeout_ms must be >= 1");
  }
  if (request_timeout_ms < 1) {
    return absl::InvalidArgumentError("request_timeout_ms must be >= 1");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Transport>> MakeTcpTransport(TcpTransportOptions options,
                                                            AgentPools pools, Tier main_tier,
                                                            std::optional<LinkPort> links) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  if (links.has_value() && (links->links == nullptr || links->agent_id.empty())) {
    return absl::InvalidArgumentError("links: a link port needs its cache and the agent's id");
  }
  sockaddr_in addr = *ParseAddress(options.listen_address, "listen_address");
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 64) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    absl::Status s = Errno(absl::StrCat("listen on ", options.listen_address));
    close(fd);
    return s;
  }
  char host[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &addr.sin_addr, host, sizeof(host));
  std::string address = absl::StrCat(host, ":", ntohs(addr.sin_port));
  return std::unique_ptr<Transport>(new TcpTransport(std::move(options), pools, main_tier, fd,
                                                     std::move(address), std::move(links)));
}

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const TransportContext& context) {
  return MakeTcpTransport(context.data, context.pools, context.main_tier);
}

}  // namespace kvcm
