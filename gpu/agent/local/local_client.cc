#include "gpu/agent/local/local_client.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

absl::Status Errno(absl::StatusCode code, absl::string_view what) {
  return absl::Status(code, absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MemfdRegion>> MemfdRegion::Create(uint64_t bytes, bool seal,
                                                                 bool allocate) {
  const int fd = memfd_create("kvcm-engine-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Errno(absl::StatusCode::kInternal, "memfd_create");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      (allocate && fallocate(fd, 0, 0, static_cast<off_t>(bytes)) != 0) ||
      (seal && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0)) {
    const absl::Status s = Errno(absl::StatusCode::kInternal, "memfd: size, allocation or seal");
    close(fd);
    return s;
  }
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    const absl::Status s = Errno(absl::StatusCode::kInternal, "memfd: mmap");
    close(fd);
    return s;
  }
  return std::unique_ptr<MemfdRegion>(new MemfdRegion(fd, static_cast<std::byte*>(map), bytes));
}

MemfdRegion::~MemfdRegion() {
  munmap(data_, bytes_);
  close(fd_);
}

absl::StatusOr<std::unique_ptr<LocalClient>> LocalClient::Connect(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("path too long: ", path));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno(absl::StatusCode::kUnavailable, "socket");
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const absl::Status s = Errno(absl::StatusCode::kUnavailable, absl::StrCat("connect ", path));
    close(fd);
    return s;
  }
  return std::unique_ptr<LocalClient>(new LocalClient(fd));
}

LocalClient::~LocalClient() { close(fd_); }

absl::StatusOr<v1::LocalReply> LocalClient::Call(const v1::LocalRequest& req,
                                                 std::span<const int> fds) {
  return CallRaw(req.SerializeAsString(), fds);
}

absl::StatusOr<v1::LocalReply> LocalClient::CallRaw(absl::string_view datagram,
                                                    std::span<const int> fds) {
  iovec iov{.iov_base = const_cast<char*>(datagram.data()), .iov_len = datagram.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(fds.empty() ? 0 : CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  if (sendmsg(fd_, &msg, MSG_NOSIGNAL) < 0) {
    return Errno(absl::StatusCode::kUnavailable, "local socket: send");
  }
  char buf[4096];
  ssize_t n;
  do {
    n = recv(fd_, buf, sizeof(buf), 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Errno(absl::StatusCode::kUnavailable, "local socket: recv");
  if (n == 0) return absl::UnavailableError("local socket: the agent closed the connection");
  v1::LocalReply reply;
  if (!reply.ParseFromArray(buf, static_cast<int>(n))) {
    return absl::InternalError("local socket: the reply is not a LocalReply");
  }
  return reply;
}

absl::Status LocalReplyStatus(const v1::LocalReply& reply) {
  if (reply.code() == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
}

}  // namespace kvcm
