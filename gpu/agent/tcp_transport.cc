#include "gpu/agent/tcp_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/internal/endian.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvcm/v1/agent.pb.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

constexpr uint32_t kMaxFrameBytes = 16 << 20;  // a request of ~800k blocks; plenty
constexpr uint8_t kTagBlock = 1;
constexpr uint8_t kTagError = 2;
constexpr size_t kHashBytes = 16;

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// "a.b.c.d:port" -> sockaddr; INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<sockaddr_in> ParseAddress(absl::string_view address, absl::string_view field) {
  const size_t colon = address.rfind(':');
  uint32_t port = 0;
  sockaddr_in out{};
  out.sin_family = AF_INET;
  const std::string host(address.substr(0, colon == absl::string_view::npos ? 0 : colon));
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port > 65535 || inet_pton(AF_INET, host.c_str(), &out.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be \"a.b.c.d:port\" (numeric IPv4), got \"", address, "\""));
  }
  out.sin_port = htons(static_cast<uint16_t>(port));
  return out;
}

// Blocking I/O on a socket with SO_RCVTIMEO / SO_SNDTIMEO set: a peer silent for the timeout
// fails the call (DEADLINE_EXCEEDED), a closed or reset one UNAVAILABLE.
absl::Status SendAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t sent = send(fd, p, n, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return absl::DeadlineExceededError("peer stopped reading");
      }
      return Errno("send");
    }
    p += sent;
    n -= static_cast<size_t>(sent);
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t got = recv(fd, p, n, 0);
    if (got == 0) return absl::UnavailableError("peer closed the connection");
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return absl::DeadlineExceededError("peer went silent");
      }
      return Errno("recv");
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

absl::Status SendFrame(int fd, const google::protobuf::MessageLite& message) {
  const std::string body = message.SerializeAsString();
  char len[4];
  absl::little_endian::Store32(len, static_cast<uint32_t>(body.size()));
  if (absl::Status s = SendAll(fd, len, sizeof(len)); !s.ok()) return s;
  return SendAll(fd, body.data(), body.size());
}

absl::Status RecvFrame(int fd, google::protobuf::MessageLite* message) {
  char len[4];
  if (absl::Status s = RecvAll(fd, len, sizeof(len)); !s.ok()) return s;
  const uint32_t n = absl::little_endian::Load32(len);
  if (n > kMaxFrameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("frame of ", n, " bytes is too large"));
  }
  std::string body(n, '\0');
  if (absl::Status s = RecvAll(fd, body.data(), n); !s.ok()) return s;
  if (!message->ParseFromString(body)) return absl::InvalidArgumentError("malformed frame");
  return absl::OkStatus();
}

void SetSocketOptions(int fd, uint32_t io_timeout_ms) {
  timeval tv{};
  tv.tv_sec = io_timeout_ms / 1000;
  tv.tv_usec = static_cast<suseconds_t>(io_timeout_ms % 1000) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

v1::PullBlocksHeader HeaderOf(const absl::Status& status, uint64_t bytes_per_block) {
  v1::PullBlocksHeader h;
  h.set_code(static_cast<int32_t>(status.code()));
  h.set_message(std::string(status.message()));
  h.set_bytes_per_block(bytes_per_block);
  return h;
}

absl::Status StatusOf(const v1::PullBlocksHeader& h) {
  if (h.code() == 0) return absl::OkStatus();
  constexpr int32_t kMaxCode = static_cast<int32_t>(absl::StatusCode::kUnauthenticated);
  const absl::StatusCode code = h.code() > 0 && h.code() <= kMaxCode
                                    ? static_cast<absl::StatusCode>(h.code())
                                    : absl::StatusCode::kUnknown;
  return absl::Status(code, absl::StrCat("peer: ", h.message()));
}

class TcpTransport final : public Transport {
 public:
  TcpTransport(TcpTransportOptions options, AgentPools pools, Tier main_tier, int listen_fd,
               std::string address)
      : options_(std::move(options)),
        pools_(pools),
        main_tier_(main_tier),
        listen_fd_(listen_fd),
        address_(std::move(address)) {
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }

  ~TcpTransport() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      for (int fd : open_fds_) shutdown(fd, SHUT_RDWR);  // wakes blocked sends and recvs
    }
    shutdown(listen_fd_, SHUT_RDWR);
    acceptor_.join();
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
    }
    close(fd);
  }

  void AcceptLoop() {
    while (true) {
      const int fd = accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // the listener was shut down
      }
      {
        absl::MutexLock lock(&mu_);
        auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || serving_ < options_.max_served_transfers;
        };
        mu_.Await(absl::Condition(&room));
        if (stopping_) {
          close(fd);
          return;
        }
        ++serving_;
      }
      Spawn([this, fd] {
        if (Track(fd)) {
          SetSocketOptions(fd, options_.io_timeout_ms);
          Serve(fd);
          Untrack(fd);
        } else {
          close(fd);
        }
        absl::MutexLock lock(&mu_);
        --serving_;
      });
    }
  }

  // One served pull: the request, the header, then every block or an error.
  void Serve(int fd) {
    v1::PullBlocksRequest req;
    if (!RecvFrame(fd, &req).ok()) return;
    BlockPool* pool = pools_.ForWireTier(main_tier_, req.tier());
    const uint64_t block_bytes = pool != nullptr ? pool->geometry().bytes_per_block() : 0;
    absl::StatusOr<NamespaceId> ns =
        NamespaceFromProto(req.has_namespace_() ? &req.namespace_() : nullptr, "namespace");
    absl::Status check;
    if (pool == nullptr) {
      check = absl::InvalidArgumentError(
          absl::StrCat("tier ", static_cast<int>(req.tier()), " is not a pool of this agent"));
    } else if (!ns.ok()) {
      check = ns.status();
    } else if (req.block_ids_size() == 0) {
      check = absl::InvalidArgumentError("block_ids is empty");
    } else if (req.page_hashes().size() != kHashBytes * req.block_ids_size()) {
      check = absl::InvalidArgumentError("page_hashes must hold 16 bytes per block");
    }
    if (!SendFrame(fd, HeaderOf(check, block_bytes)).ok() || !check.ok()) return;

    const std::vector<PageHash> pages = DecodePageHashes(req.page_hashes());
    std::vector<std::byte> staging(block_bytes);
    for (int i = 0; i < req.block_ids_size(); ++i) {
      // The pool's lock is held for this copy only, never while the socket waits.
      absl::Status read = pool->ReadCommittedBlock(req.block_ids(i), *ns, pages[i], staging,
                                                   absl::StrCat("block_ids[", i, "]"));
      if (!read.ok()) {
        if (SendAll(fd, &kTagError, 1).ok()) (void)SendFrame(fd, HeaderOf(read, block_bytes));
        return;
      }
      if (!SendAll(fd, &kTagBlock, 1).ok() || !SendAll(fd, staging.data(), staging.size()).ok()) {
        return;  // the puller went away
      }
    }
  }

  absl::StatusOr<uint64_t> RunPull(const PullSpec& spec) {
    const size_t n = spec.peer_blocks.size();
    if (spec.dst == nullptr || n == 0 || spec.pages.size() != n || spec.dst_blocks.size() != n) {
      return absl::InvalidArgumentError(
          "a pull needs a destination pool and one page and one destination block per peer "
          "block");
    }
    absl::StatusOr<sockaddr_in> peer = ParseAddress(spec.peer_address, "peer_address");
    if (!peer.ok()) return peer.status();
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return Errno("socket");
    if (!Track(fd)) {
      close(fd);
      return absl::CancelledError("the transport is stopping");
    }
    absl::StatusOr<uint64_t> result = PullOn(fd, *peer, spec);
    Untrack(fd);
    return result;
  }

  absl::StatusOr<uint64_t> PullOn(int fd, const sockaddr_in& peer, const PullSpec& spec) {
    SetSocketOptions(fd, options_.io_timeout_ms);
    if (connect(fd, reinterpret_cast<const sockaddr*>(&peer), sizeof(peer)) != 0) {
      return Errno(absl::StrCat("connect to ", spec.peer_address));
    }
    v1::PullBlocksRequest req;
    req.set_tier(static_cast<v1::Tier>(spec.peer_tier));
    NamespaceToProto(spec.ns, req.mutable_namespace_());
    req.mutable_block_ids()->Add(spec.peer_blocks.begin(), spec.peer_blocks.end());
    req.set_page_hashes(EncodePageHashes(spec.pages));
    if (absl::Status s = SendFrame(fd, req); !s.ok()) return s;

    v1::PullBlocksHeader header;
    if (absl::Status s = RecvFrame(fd, &header); !s.ok()) return s;
    if (absl::Status s = StatusOf(header); !s.ok()) return s;
    const uint64_t block_bytes = spec.dst->geometry().bytes_per_block();
    if (header.bytes_per_block() != block_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer blocks are ", header.bytes_per_block(), " bytes, ours ", block_bytes));
    }
    std::vector<std::byte> staging(block_bytes);
    for (size_t i = 0; i < spec.peer_blocks.size(); ++i) {
      uint8_t tag = 0;
      if (absl::Status s = RecvAll(fd, &tag, 1); !s.ok()) return s;
      if (tag == kTagError) {
        if (absl::Status s = RecvFrame(fd, &header); !s.ok()) return s;
        return StatusOf(header);
      }
      if (tag != kTagBlock) return absl::DataLossError(absl::StrCat("unknown tag ", tag));
      if (absl::Status s = RecvAll(fd, staging.data(), staging.size()); !s.ok()) return s;
      if (absl::Status s =
              spec.dst->WriteBlocks({&spec.dst_blocks[i], 1}, spec.dst_owner_epoch, staging);
          !s.ok()) {
        return s;
      }
    }
    return block_bytes * spec.peer_blocks.size();
  }

  const TcpTransportOptions options_;
  const AgentPools pools_;
  const Tier main_tier_;
  const int listen_fd_;
  const std::string address_;
  std::thread acceptor_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint32_t serving_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<int> open_fds_ ABSL_GUARDED_BY(mu_);
  std::list<Worker> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status TcpTransportOptions::Validate() const {
  if (absl::StatusOr<sockaddr_in> a = ParseAddress(listen_address, "listen_address"); !a.ok()) {
    return a.status();
  }
  if (io_timeout_ms < 1) return absl::InvalidArgumentError("io_timeout_ms must be >= 1");
  if (max_served_transfers < 1) {
    return absl::InvalidArgumentError("max_served_transfers must be >= 1");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Transport>> MakeTcpTransport(TcpTransportOptions options,
                                                            AgentPools pools, Tier main_tier) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
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
  return std::unique_ptr<Transport>(
      new TcpTransport(std::move(options), pools, main_tier, fd, std::move(address)));
}

}  // namespace kvcm
