#include "gpu/agent/local/local_socket_server.h"

#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace kvcm {
namespace {

// Most descriptors read from one datagram; more is a malformed request (the kernel closes
// those that do not fit).
constexpr int kMaxFdsPerMessage = 8;

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

enum class Wait { kReadable, kStopped, kTimedOut };

// Waits until `fd` is readable, `wake_fd` is (Stop) or `deadline` passed (InfiniteFuture: never).
Wait WaitReadable(int fd, int wake_fd, absl::Time deadline = absl::InfiniteFuture()) {
  for (;;) {
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return Wait::kTimedOut;
      timeout_ms = static_cast<int>(
          absl::ToInt64Milliseconds(left + absl::Milliseconds(1) - absl::Nanoseconds(1)));
    }
    pollfd p[2] = {{.fd = fd, .events = POLLIN}, {.fd = wake_fd, .events = POLLIN}};
    const int n = poll(p, 2, timeout_ms);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || (p[1].revents & POLLIN) != 0) return Wait::kStopped;
    if (p[0].revents != 0) return Wait::kReadable;
  }
}

// The gid of group `name` (a name or a number).
absl::StatusOr<gid_t> GroupId(const std::string& name) {
  uint32_t number = 0;
  if (absl::SimpleAtoi(name, &number)) return static_cast<gid_t>(number);
  group g{};
  group* found = nullptr;
  std::vector<char> buf(16384);
  if (getgrnam_r(name.c_str(), &g, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("local_socket_group: no group named \"", name, "\""));
  }
  return found->gr_gid;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LocalSocketServer>> LocalSocketServer::Start(
    LocalSocketOptions options, LocalSessionEnv env) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options.path.empty() || options.path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("local_socket must be 1..",
                                                   sizeof(addr.sun_path) - 1, " bytes, got ",
                                                   options.path.size()));
  }
  if (options.max_sessions < 1 || options.max_sessions_per_uid < 1 ||
      options.hello_timeout_ms < 1) {
    return absl::InvalidArgumentError(
        "local_max_sessions, local_max_sessions_per_uid and local_hello_timeout_ms must be >= 1");
  }
  std::optional<gid_t> group;
  if (!options.socket_group.empty()) {
    KVCM_ASSIGN_OR_RETURN(group, GroupId(options.socket_group));
  }
  const mode_t mode = group.has_value() ? 0660 : 0600;
  std::memcpy(addr.sun_path, options.path.data(), options.path.size());
  // A previous agent's socket is replaced; nothing else is ever deleted.
  struct stat st {};
  if (lstat(options.path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("local_socket ", options.path, " exists and is not a socket"));
    }
    unlink(options.path.c_str());
  }
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("local_socket: socket");
  // Mode 0600 from the moment the file exists (the socket inode's mode, less the umask, is
  // what bind gives the file), and `mode` in `group` after, whatever the umask.
  fchmod(fd, 0600);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const absl::Status s = Errno(absl::StrCat("local_socket: bind ", options.path));
    close(fd);
    return s;
  }
  if ((group.has_value() && chown(options.path.c_str(), static_cast<uid_t>(-1), *group) != 0) ||
      chmod(options.path.c_str(), mode) != 0 || listen(fd, 64) != 0) {
    const absl::Status s = Errno(absl::StrCat("local_socket: listen ", options.path));
    close(fd);
    unlink(options.path.c_str());
    return s;
  }
  const int wake = eventfd(0, EFD_CLOEXEC);
  if (wake < 0) {
    const absl::Status s = Errno("local_socket: eventfd");
    close(fd);
    unlink(options.path.c_str());
    return s;
  }
  std::unique_ptr<LocalSocketServer> server(
      new LocalSocketServer(std::move(options), env, fd, wake));
  server->acceptor_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  const LocalSocketOptions& o = server->options_;
  LogInfo(absl::StrCat(
      "local data path on ", server->path(), " (mode ", absl::StrFormat("%04o", mode),
      group.has_value() ? absl::StrCat(", group ", *group) : std::string(), "; admits ",
      o.allowed_uids.empty() && o.allowed_gids.empty()
          ? absl::StrCat("uid ", geteuid(), " only")
          : absl::StrCat("uids [", absl::StrJoin(o.allowed_uids, ","), "] gids [",
                         absl::StrJoin(o.allowed_gids, ","), "]"),
      "; at most ", o.max_sessions, " sessions, ", o.max_sessions_per_uid,
      " per uid; hello within ", o.hello_timeout_ms, " ms)"));
  return server;
}

LocalSocketServer::LocalSocketServer(LocalSocketOptions options, LocalSessionEnv env, int listen_fd,
                                     int wake_fd)
    : options_(std::move(options)),
      env_([&] {
        env.principal_uids = options_.principal_uids.empty() ? nullptr : &options_.principal_uids;
        return env;
      }()),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd) {}

LocalSocketServer::~LocalSocketServer() {
  Stop();
  close(listen_fd_);
  close(wake_fd_);
}

void LocalSocketServer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  if (acceptor_.joinable()) acceptor_.join();
  std::list<std::unique_ptr<Connection>> connections;
  {
    absl::MutexLock lock(&mu_);
    connections.swap(connections_);
  }
  for (const std::unique_ptr<Connection>& c : connections) {
    shutdown(c->fd, SHUT_RDWR);  // a session blocked in send returns
    if (c->thread.joinable()) c->thread.join();
    close(c->fd);
  }
  unlink(options_.path.c_str());
}

uint32_t LocalSocketServer::active_sessions() const {
  absl::MutexLock lock(&mu_);
  uint32_t n = 0;
  for (const std::unique_ptr<Connection>& c : connections_) n += c->done ? 0 : 1;
  return n;
}

void LocalSocketServer::Reap() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if ((*it)->done) {
      (*it)->thread.join();
      close((*it)->fd);
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

bool LocalSocketServer::Admitted(uint32_t uid, uint32_t gid) const {
  if (options_.allowed_uids.empty() && options_.allowed_gids.empty()) return uid == geteuid();
  return absl::c_linear_search(options_.allowed_uids, uid) ||
         absl::c_linear_search(options_.allowed_gids, gid);
}

void LocalSocketServer::Refuse(int fd, absl::string_view result, const std::string& peer,
                               absl::string_view why) {
  // Counted and logged before the close: a peer that sees the hang-up sees them too.
  refused_.fetch_add(1, std::memory_order_relaxed);
  if (env_.metrics != nullptr) env_.metrics->RecordLocalSession(result);
  LogWarning(absl::StrCat("local_socket: closed the connection of ", peer, ": ", why));
  close(fd);
}

void LocalSocketServer::AcceptLoop() {
  while (WaitReadable(listen_fd_, wake_fd_) == Wait::kReadable) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        LogWarning(absl::StrCat("local_socket: accept: ", std::strerror(errno)));
        usleep(10'000);  // the pending connection stays queued; do not spin on it
      }
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      Refuse(fd, "not_allowed", "an unknown peer", "no SO_PEERCRED credentials");
      continue;
    }
    const std::string peer = absl::StrCat("uid ", cred.uid, " gid ", cred.gid, " pid ", cred.pid);
    if (!Admitted(cred.uid, cred.gid)) {
      Refuse(fd, "not_allowed", peer,
             "neither its uid nor its gid is admitted (local_allowed_uids, local_allowed_gids)");
      continue;
    }
    absl::MutexLock lock(&mu_);
    Reap();
    if (stopped_ || connections_.size() >= options_.max_sessions) {
      Refuse(fd, "refused", peer,
             absl::StrCat(options_.max_sessions, " sessions (local_max_sessions) are open"));
      continue;
    }
    const size_t of_uid = absl::c_count_if(
        connections_, [&](const std::unique_ptr<Connection>& c) { return c->uid == cred.uid; });
    if (of_uid >= options_.max_sessions_per_uid) {
      Refuse(fd, "uid_limit", peer,
             absl::StrCat(of_uid, " connections of uid ", cred.uid,
                          " are open (local_max_sessions_per_uid)"));
      continue;
    }
    auto conn = std::make_unique<Connection>();
    conn->fd = fd;
    conn->uid = cred.uid;
    Connection* c = conn.get();
    connections_.push_back(std::move(conn));
    c->thread = std::thread([this, c, peer] { Serve(c, peer); });
  }
}

void LocalSocketServer::Serve(Connection* conn, std::string peer) {
  LocalSession session(env_, peer, conn->uid);
  // Until a hello registers a region, the connection lives at most hello_timeout_ms.
  const absl::Time hello_deadline = absl::Now() + absl::Milliseconds(options_.hello_timeout_ms);
  // Untouched pages of the buffer cost nothing: requests are small.
  const std::unique_ptr<char[]> buf(new char[LocalSession::kMaxRequestBytes]);
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  for (;;) {
    const Wait w = WaitReadable(conn->fd, wake_fd_,
                                session.registered() ? absl::InfiniteFuture() : hello_deadline);
    if (w == Wait::kTimedOut) {
      if (env_.metrics != nullptr) env_.metrics->RecordLocalSession("hello_timeout");
      LogWarning(absl::StrCat("local_socket: closed the connection of ", peer,
                              ": no region registered within ", options_.hello_timeout_ms,
                              " ms (local_hello_timeout_ms)"));
      break;
    }
    if (w != Wait::kReadable) break;
    iovec iov{.iov_base = buf.get(), .iov_len = LocalSession::kMaxRequestBytes};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(conn->fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) break;
    if (n == 0) {
      // A hang-up, or an empty datagram (an empty LocalRequest): only a hang-up sets RDHUP.
      pollfd p{.fd = conn->fd, .events = POLLRDHUP};
      if (poll(&p, 1, 0) != 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) break;
    }
    std::vector<int> fds;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds.push_back(fd);
      }
    }
    v1::LocalReply reply;
    if ((msg.msg_flags & MSG_CTRUNC) != 0) {
      for (int fd : fds) close(fd);
      reply.set_code(static_cast<uint32_t>(absl::StatusCode::kInvalidArgument));
      reply.set_message(
          absl::StrCat("request: more than ", kMaxFdsPerMessage, " file descriptors"));
    } else {
      reply = session.Handle(absl::string_view(buf.get(), static_cast<size_t>(n)), std::move(fds),
                             (msg.msg_flags & MSG_TRUNC) != 0);
    }
    const std::string out = reply.SerializeAsString();
    if (send(conn->fd, out.data(), out.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(out.size()) ||
        session.ended()) {
      break;
    }
  }
  shutdown(conn->fd, SHUT_RDWR);  // the peer sees the end now; the fd closes when reaped
  conn->done = true;
}

}  // namespace kvcm
