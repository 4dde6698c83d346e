#include "gpu/agent/transport/data_socket.h"

#include <arpa/inet.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/base/internal/endian.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gpu/agent/transport/data_tls.h"

namespace kvcm {
namespace {

constexpr uint32_t kMaxFrameBytes = 16 << 20;  // a request of ~800k blocks; plenty

}  // namespace

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

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

absl::Status SendAll(DataConn& conn, const void* data, size_t n) {
  if (conn.ssl() != nullptr) return TlsSendAll(conn.ssl(), data, n);
  const int fd = conn.fd();
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

absl::Status RecvAll(DataConn& conn, void* data, size_t n) {
  if (conn.ssl() != nullptr) return TlsRecvAll(conn.ssl(), data, n);
  const int fd = conn.fd();
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

absl::Status SendFrame(DataConn& conn, const google::protobuf::MessageLite& message) {
  // One write of length and body: one TLS record (and one segment) for a small frame.
  std::string framed(4, '\0');
  absl::little_endian::Store32(framed.data(), static_cast<uint32_t>(message.ByteSizeLong()));
  message.AppendToString(&framed);
  return SendAll(conn, framed.data(), framed.size());
}

absl::Status RecvFrame(DataConn& conn, google::protobuf::MessageLite* message) {
  char len[4];
  if (absl::Status s = RecvAll(conn, len, sizeof(len)); !s.ok()) return s;
  const uint32_t n = absl::little_endian::Load32(len);
  if (n > kMaxFrameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("frame of ", n, " bytes is too large"));
  }
  std::string body(n, '\0');
  if (absl::Status s = RecvAll(conn, body.data(), n); !s.ok()) return s;
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

absl::Status CheckPeerOpen(const DataConn& conn) {
  char byte;
  const ssize_t got = recv(conn.fd(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (got == 0) return absl::UnavailableError("peer closed the connection");
  if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return Errno("recv");
  return absl::OkStatus();
}

}  // namespace kvcm
