#include "gpu/agent/local/local_socket_server.h"

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvcm {
namespace {

// Most descriptors read from one datagram; more is a malformed request (the kernel closes
// those that do not fit).
constexpr int kMaxFdsPerMessage = 8;

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Waits until `fd` is readable or `wake_fd` is (Stop): true for `fd`.
bool WaitReadable(int fd, int wake_fd) {
  for (;;) {
    pollfd p[2] = {{.fd = fd, .events = POLLIN}, {.fd = wake_fd, .events = POLLIN}};
    const int n = poll(p, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || (p[1].revents & POLLIN) != 0) return false;
    if (p[0].revents != 0) return true;
  }
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
  if (options.max_sessions < 1) {
    return absl::InvalidArgumentError("local_max_sessions must be >= 1");
  }
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
  // what bind gives the file), and again after, whatever the umask.
  fchmod(fd, 0600);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const absl::Status s = Errno(absl::StrCat("local_socket: bind ", options.path));
    close(fd);
    return s;
  }
  if (chmod(options.path.c_str(), 0600) != 0 || listen(fd, 64) != 0) {
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
  LogInfo(absl::StrCat("local data path on ", server->path(), " (at most ",
                       server->options_.max_sessions, " sessions)"));
  return server;
}

LocalSocketServer::LocalSocketServer(LocalSocketOptions options, LocalSessionEnv env, int listen_fd,
                                     int wake_fd)
    : options_(std::move(options)), env_(env), listen_fd_(listen_fd), wake_fd_(wake_fd) {}

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

void LocalSocketServer::AcceptLoop() {
  while (WaitReadable(listen_fd_, wake_fd_)) {
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
    const std::string peer = getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0
                                 ? absl::StrCat("uid ", cred.uid, " pid ", cred.pid)
                                 : std::string("an unknown peer");
    absl::MutexLock lock(&mu_);
    Reap();
    if (stopped_ || connections_.size() >= options_.max_sessions) {
      // Counted before the close: a peer that sees the hang-up sees the count too.
      refused_.fetch_add(1, std::memory_order_relaxed);
      if (env_.metrics != nullptr) env_.metrics->RecordLocalSession(false);
      close(fd);
      LogWarning(absl::StrCat("local_socket: closed the connection of ", peer, ": ",
                              options_.max_sessions, " sessions (local_max_sessions) are open"));
      continue;
    }
    auto conn = std::make_unique<Connection>();
    conn->fd = fd;
    Connection* c = conn.get();
    connections_.push_back(std::move(conn));
    c->thread = std::thread([this, c, peer] { Serve(c, peer); });
  }
}

void LocalSocketServer::Serve(Connection* conn, std::string peer) {
  LocalSession session(env_, std::move(peer));
  // Untouched pages of the buffer cost nothing: requests are small.
  const std::unique_ptr<char[]> buf(new char[LocalSession::kMaxRequestBytes]);
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  while (WaitReadable(conn->fd, wake_fd_)) {
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
    if (send(conn->fd, out.data(), out.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(out.size())) {
      break;
    }
  }
  shutdown(conn->fd, SHUT_RDWR);  // the peer sees the end now; the fd closes when reaped
  conn->done = true;
}

}  // namespace kvcm
