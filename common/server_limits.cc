#include "common/server_limits.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "grpc/support/log.h"

namespace kvcm {
namespace {

absl::Status Invalid(absl::string_view prefix, absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(prefix, name, " ", what));
}

int RawAccept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  return static_cast<int>(syscall(SYS_accept4, fd, addr, len, flags));
}

// How often, at most, a cap check re-validates the tracked fds (fstat each): between two
// prunes a connection gRPC closed still counts, so a cap can refuse for up to this long after
// room was made.
constexpr absl::Duration kPruneInterval = absl::Milliseconds(50);

// The accept4 guard's state: the connections it handed out, by fd, with the socket inode that
// fd named then (an fd gRPC closed and the kernel reused names another inode).
class AcceptGuard {
 public:
  static AcceptGuard& Get() {
    static AcceptGuard* const kGuard = new AcceptGuard();
    return *kGuard;
  }

  void Install(uint32_t max_total, uint32_t max_per_peer) {
    absl::MutexLock lock(&mu_);
    max_total_ = max_total;
    max_per_peer_ = max_per_peer;
    if (reserve_fd_ < 0) reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    enabled_ = true;
  }

  AcceptGuardCounters Counters() {
    absl::MutexLock lock(&mu_);
    return counters_;
  }

  int Accept(int listen_fd, sockaddr* addr, socklen_t* len, int flags) {
    {
      absl::MutexLock lock(&mu_);
      if (!enabled_) return RawAccept4(listen_fd, addr, len, flags);
    }
    while (true) {
      sockaddr_storage peer{};
      socklen_t peer_len = sizeof(peer);
      const int fd = RawAccept4(listen_fd, reinterpret_cast<sockaddr*>(&peer), &peer_len, flags);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          Shed(listen_fd);
          errno = EAGAIN;  // gRPC re-arms the listener instead of ending it
        }
        return -1;
      }
      std::string key = PeerKey(peer);
      if (!key.empty() && !Admit(fd, std::move(key))) {
        close(fd);
        continue;
      }
      if (addr != nullptr && len != nullptr) {
        std::memcpy(addr, &peer, std::min(*len, peer_len));
        *len = peer_len;
      }
      return fd;
    }
  }

 private:
  struct Entry {
    ino_t ino;
    std::string peer;
  };

  // The IP address of a TCP peer (a v4-mapped v6 address as v4); empty for other families.
  static std::string PeerKey(const sockaddr_storage& peer) {
    if (peer.ss_family == AF_INET) {
      const auto& in = reinterpret_cast<const sockaddr_in&>(peer);
      return std::string(reinterpret_cast<const char*>(&in.sin_addr), 4);
    }
    if (peer.ss_family == AF_INET6) {
      const auto& in6 = reinterpret_cast<const sockaddr_in6&>(peer);
      if (IN6_IS_ADDR_V4MAPPED(&in6.sin6_addr)) {
        return std::string(reinterpret_cast<const char*>(&in6.sin6_addr) + 12, 4);
      }
      return std::string(reinterpret_cast<const char*>(&in6.sin6_addr), 16);
    }
    return "";
  }

  bool Admit(int fd, std::string peer) ABSL_LOCKS_EXCLUDED(mu_) {
    struct stat st {};
    if (fstat(fd, &st) != 0) return false;
    absl::MutexLock lock(&mu_);
    Forget(fd);  // the kernel reused the number: the connection it named is gone
    auto over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (by_fd_.size() >= max_total_) return 1;
      auto it = per_peer_.find(peer);
      if (it != per_peer_.end() && it->second >= max_per_peer_) return 2;
      return 0;
    };
    int why = over();
    if (why != 0 && absl::Now() - last_prune_ >= kPruneInterval) {
      Prune();
      why = over();
    }
    if (why == 1) {
      ++counters_.refused_total_cap;
      return false;
    }
    if (why == 2) {
      ++counters_.refused_peer_cap;
      return false;
    }
    ++per_peer_[peer];
    by_fd_[fd] = Entry{st.st_ino, std::move(peer)};
    ++counters_.accepted;
    return true;
  }

  void Forget(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = by_fd_.find(fd);
    if (it == by_fd_.end()) return;
    auto peer = per_peer_.find(it->second.peer);
    if (peer != per_peer_.end() && --peer->second == 0) per_peer_.erase(peer);
    by_fd_.erase(it);
  }

  // Drops the entries whose fd no longer names the socket it was accepted as.
  void Prune() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    last_prune_ = absl::Now();
    std::vector<int> gone;
    for (const auto& [fd, entry] : by_fd_) {
      struct stat st {};
      if (fstat(fd, &st) != 0 || st.st_ino != entry.ino || !S_ISSOCK(st.st_mode)) {
        gone.push_back(fd);
      }
    }
    for (int fd : gone) Forget(fd);
  }

  // Out of fds: frees the reserved one, accepts and closes every pending connection with
  // it, and takes it again, so that the queue does not stay full (the libev/nginx trick).
  void Shed(int listen_fd) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (reserve_fd_ >= 0) {
      close(reserve_fd_);
      reserve_fd_ = -1;
    }
    while (true) {
      const int fd = RawAccept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) break;
      close(fd);
      ++counters_.shed_fd_exhausted;
    }
    reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    Prune();  // gRPC may have closed some since
  }

  absl::Mutex mu_;
  bool enabled_ ABSL_GUARDED_BY(mu_) = false;
  uint32_t max_total_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t max_per_peer_ ABSL_GUARDED_BY(mu_) = 0;
  int reserve_fd_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time last_prune_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::flat_hash_map<int, Entry> by_fd_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint32_t> per_peer_ ABSL_GUARDED_BY(mu_);
  AcceptGuardCounters counters_ ABSL_GUARDED_BY(mu_);
};

std::atomic<LogRateLimiter*> grpc_log_limiter{nullptr};

void LogGrpcLine(gpr_log_func_args* args) {
  LogRateLimiter* limiter = grpc_log_limiter.load(std::memory_order_acquire);
  const LogSeverity severity = args->severity == GPR_LOG_SEVERITY_ERROR  ? LogSeverity::kError
                               : args->severity == GPR_LOG_SEVERITY_INFO ? LogSeverity::kInfo
                                                                         : LogSeverity::kWarning;
  // gRPC's file names are build paths ("./src/core/..."); the base name is enough.
  absl::string_view file = args->file != nullptr ? args->file : "";
  if (const size_t slash = file.rfind('/'); slash != absl::string_view::npos) {
    file.remove_prefix(slash + 1);
  }
  limiter->Log(severity, absl::StrCat("grpc ", file, ":", args->line, " ", args->message));
}

}  // namespace

void RateLimitGrpcLog(int max_lines_per_second) {
  static LogRateLimiter* const limiter = new LogRateLimiter(max_lines_per_second, absl::Seconds(1));
  grpc_log_limiter.store(limiter, std::memory_order_release);
  gpr_set_log_function(&LogGrpcLine);
}

uint64_t SuppressedGrpcLogLines() {
  LogRateLimiter* limiter = grpc_log_limiter.load(std::memory_order_acquire);
  return limiter == nullptr ? 0 : limiter->suppressed_total();
}

absl::Status ServerLimitsOptions::Validate(absl::string_view prefix) const {
  if (handshake_timeout_ms < 100 || handshake_timeout_ms > 120'000) {
    return Invalid(prefix, "handshake_timeout_ms",
                   absl::StrCat("must be in [100, 120000], got ", handshake_timeout_ms));
  }
  if (keepalive_time_ms < 1'000) {
    return Invalid(prefix, "keepalive_time_ms",
                   absl::StrCat("must be >= 1000, got ", keepalive_time_ms));
  }
  if (keepalive_timeout_ms < 100) {
    return Invalid(prefix, "keepalive_timeout_ms",
                   absl::StrCat("must be >= 100, got ", keepalive_timeout_ms));
  }
  if (max_concurrent_streams < 1 || max_concurrent_streams > 1'000'000) {
    return Invalid(prefix, "max_concurrent_streams",
                   absl::StrCat("must be in [1, 1000000], got ", max_concurrent_streams));
  }
  if (memory_bytes < (16ull << 20)) {
    return Invalid(prefix, "memory_bytes",
                   absl::StrCat("must be >= 16777216 (16 MiB), got ", memory_bytes));
  }
  if (max_threads < 2) {
    return Invalid(prefix, "max_threads", absl::StrCat("must be >= 2, got ", max_threads));
  }
  if (max_connections < 1) return Invalid(prefix, "max_connections", "must be >= 1");
  if (max_connections_per_peer < 1) {
    return Invalid(prefix, "max_connections_per_peer", "must be >= 1");
  }
  if (fd_reserve < 64 || fd_reserve > 1'000'000) {
    return Invalid(prefix, "fd_reserve",
                   absl::StrCat("must be in [64, 1000000], got ", fd_reserve));
  }
  return absl::OkStatus();
}

void ApplyServerLimits(const ServerLimitsOptions& o, grpc::ServerBuilder* builder) {
  auto arg = [builder](const char* name, uint32_t value) {
    builder->AddChannelArgument(name, static_cast<int>(std::min<uint32_t>(value, INT32_MAX)));
  };
  arg(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, o.handshake_timeout_ms);
  if (o.max_connection_idle_ms > 0) arg(GRPC_ARG_MAX_CONNECTION_IDLE_MS, o.max_connection_idle_ms);
  arg(GRPC_ARG_KEEPALIVE_TIME_MS, o.keepalive_time_ms);
  arg(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, o.keepalive_timeout_ms);
  // Ping idle connections too (no call in flight): those are the ones a vanished peer leaves.
  arg(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  arg(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  arg(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, o.min_client_ping_interval_ms);
  arg(GRPC_ARG_HTTP2_MAX_PING_STRIKES, o.max_ping_strikes);
  arg(GRPC_ARG_MAX_CONCURRENT_STREAMS, o.max_concurrent_streams);
  grpc::ResourceQuota quota("kvcm-server");
  quota.Resize(static_cast<size_t>(o.memory_bytes));
  quota.SetMaxThreads(static_cast<int>(std::min<uint32_t>(o.max_threads, INT32_MAX)));
  builder->SetResourceQuota(quota);
}

uint64_t RaiseFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  return limit.rlim_cur == RLIM_INFINITY ? uint64_t{1} << 20 : limit.rlim_cur;
}

uint32_t InstallAcceptGuard(const ServerLimitsOptions& options, uint64_t fd_limit) {
  const uint64_t room = fd_limit > options.fd_reserve ? fd_limit - options.fd_reserve : 1;
  const uint32_t total = static_cast<uint32_t>(std::min<uint64_t>(options.max_connections, room));
  AcceptGuard::Get().Install(total, options.max_connections_per_peer);
  return total;
}

std::vector<std::string> MetricsServerOptions(const std::string& address, size_t threads) {
  return {"listening_ports",    address, "num_threads",       absl::StrCat(threads),
          "connection_queue",   "16",    "listen_backlog",    "64",
          "request_timeout_ms", "5000",  "enable_keep_alive", "no",
          "linger_timeout_ms",  "0",     "max_request_size",  "16384"};
}

AcceptGuardCounters GetAcceptGuardCounters() {
  AcceptGuardCounters c = AcceptGuard::Get().Counters();
  c.interposed = dlsym(RTLD_DEFAULT, "accept4") == reinterpret_cast<void*>(&::accept4);
  return c;
}

}  // namespace kvcm

// The process's accept4: libgrpc's listener calls it (the executable exports it, see
// common/CMakeLists.txt). Without InstallAcceptGuard it is the plain system call.
extern "C" int accept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  return kvcm::AcceptGuard::Get().Accept(fd, addr, len, flags);
}
