#include "gpu/agent/transport/block_stream.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstddef>
#include <optional>

#include "absl/status/statusor.h"
#include "gpu/agent/transport/data_tls.h"

namespace kvcm {
namespace {

// Waits until `fd` can take bytes (`writable`) or has some, or has failed (the next call
// reports how); DEADLINE_EXCEEDED after `timeout`.
absl::Status WaitSocket(int fd, bool writable, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    pollfd p{.fd = fd, .events = static_cast<short>(writable ? POLLOUT : POLLIN), .revents = 0};
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    const int ready = poll(&p, 1, static_cast<int>(left_ms < 0 ? 0 : left_ms));
    if (ready > 0) return absl::OkStatus();
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return Errno("poll");
    return absl::DeadlineExceededError(writable ? "peer stopped reading" : "peer went silent");
  }
}

// The bytes of `iov` the socket takes without waiting: 0 when it has no room.
absl::StatusOr<size_t> SendNow(int fd, const iovec* iov, int iovcnt) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<size_t>(iovcnt);
  while (true) {
    const ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent >= 0) return static_cast<size_t>(sent);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return Errno("send");
  }
}

// The bytes the socket has buffered now, at most `n`: 0 when none. UNAVAILABLE at the end.
absl::StatusOr<size_t> RecvNow(int fd, std::byte* out, size_t n) {
  while (true) {
    const ssize_t got = recv(fd, out, n, MSG_DONTWAIT);
    if (got > 0) return static_cast<size_t>(got);
    if (got == 0) return absl::UnavailableError("peer closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return Errno("recv");
  }
}

// The socket non-blocking while it lives, as TlsRecvNow and TlsSendNow need (a plaintext
// send or recv asks for it per call instead).
class NonBlocking {
 public:
  explicit NonBlocking(int fd) : fd_(fd), flags_(fcntl(fd, F_GETFL)) {
    if (flags_ >= 0) fcntl(fd_, F_SETFL, flags_ | O_NONBLOCK);
  }
  ~NonBlocking() {
    if (flags_ >= 0) fcntl(fd_, F_SETFL, flags_);
  }
  NonBlocking(const NonBlocking&) = delete;
  NonBlocking& operator=(const NonBlocking&) = delete;

 private:
  const int fd_;
  const int flags_;
};

// Over TLS, the records of one lock hold: at most this many plaintext bytes.
constexpr size_t kTlsPieceBytes = 256 << 10;

// One piece of a block in place over TLS: the tag first (when `tag_sent` is false), then
// records of block[done..] until the session has no room or kTlsPieceBytes went. Returns
// the block's bytes taken; sets *tag_sent once the tag is, and *started once the session
// holds any of it (the tag's record may wait there half-written, to be retried).
absl::StatusOr<size_t> TlsSendPiece(ssl_st* ssl, const std::byte* block, uint64_t block_bytes,
                                    uint64_t done, bool* tag_sent, bool* started) {
  if (!*tag_sent) {
    *started = true;
    absl::StatusOr<size_t> r = TlsSendNow(ssl, &kTagBlock, 1);
    if (!r.ok() || *r == 0) return r;
    *tag_sent = true;
  }
  size_t sent = 0;
  while (done + sent < block_bytes && sent < kTlsPieceBytes) {
    absl::StatusOr<size_t> r = TlsSendNow(ssl, block + done + sent, block_bytes - done - sent);
    if (!r.ok()) return r;
    if (*r == 0) break;
    sent += *r;
  }
  return sent;
}

}  // namespace

bool CanSendInPlace(const BlockPool& pool) { return !pool.backend().is_device(); }

bool CanRecvInPlace(const BlockPool& pool) { return !pool.backend().is_device(); }

absl::Status SendCommittedBlockInPlace(DataConn& conn, const BlockPool& pool, BlockId id,
                                       const NamespaceId& ns, const PageHash& page,
                                       absl::string_view field, absl::Duration timeout,
                                       bool* answerable) {
  *answerable = false;
  const uint64_t block_bytes = pool.geometry().bytes_per_block();
  std::optional<NonBlocking> non_blocking;
  if (conn.ssl() != nullptr) non_blocking.emplace(conn.fd());
  bool tag_sent = false;
  bool started = false;  // the connection holds some of this block: no kTagError may follow
  uint64_t done = 0;     // bytes of the block sent
  // After a short plaintext send the socket is full: wait for room before taking the lock
  // again (a try would only find EAGAIN).
  bool full = false;
  while (done < block_bytes) {
    if (full) {
      if (absl::Status w = WaitSocket(conn.fd(), /*writable=*/true, timeout); !w.ok()) return w;
    }
    size_t sent = 0;
    bool socket_failed = false;
    absl::Status s = pool.WithCommittedBlock(id, ns, page, field, [&](const std::byte* block) {
      absl::StatusOr<size_t> r;
      if (conn.ssl() != nullptr) {
        r = TlsSendPiece(conn.ssl(), block, block_bytes, done, &tag_sent, &started);
      } else {
        // The tag rides with the first piece: one segment, not a 1-byte one of its own.
        iovec iov[2];
        int n = 0;
        if (!tag_sent) iov[n++] = {const_cast<uint8_t*>(&kTagBlock), 1};
        iov[n++] = {const_cast<std::byte*>(block + done), block_bytes - done};
        r = SendNow(conn.fd(), iov, n);
        if (r.ok() && *r > 0 && !tag_sent) {
          tag_sent = started = true;
          --*r;
        }
      }
      if (!r.ok()) {
        socket_failed = true;
        return r.status();
      }
      sent = *r;
      return absl::OkStatus();
    });
    if (!s.ok()) {
      *answerable = !started && !socket_failed;
      return s;
    }
    full = conn.ssl() == nullptr ? done + sent < block_bytes : sent == 0;
    done += sent;
  }
  // Over TLS the last records may wait in the session's write buffer.
  while (conn.ssl() != nullptr) {
    absl::StatusOr<bool> flushed = TlsFlushNow(conn.ssl());
    if (!flushed.ok()) return flushed.status();
    if (*flushed) break;
    if (absl::Status w = WaitSocket(conn.fd(), /*writable=*/true, timeout); !w.ok()) return w;
  }
  return absl::OkStatus();
}

absl::Status RecvBlockInPlace(DataConn& conn, BlockPool& pool, BlockId id, uint64_t owner_epoch,
                              uint64_t generation, absl::string_view field,
                              absl::Duration timeout) {
  const uint64_t block_bytes = pool.geometry().bytes_per_block();
  std::optional<NonBlocking> non_blocking;
  if (conn.ssl() != nullptr) non_blocking.emplace(conn.fd());
  uint64_t done = 0;  // bytes of the block received
  // After a short plaintext receive the socket is empty: wait for bytes before taking the
  // lock again (a try would only find EAGAIN).
  bool empty = false;
  while (done < block_bytes) {
    if (empty) {
      if (absl::Status w = WaitSocket(conn.fd(), /*writable=*/false, timeout); !w.ok()) return w;
    }
    size_t got = 0;
    absl::Status s = pool.WithWritableBlock(
        id, owner_epoch, field,
        [&](std::byte* block) -> absl::StatusOr<uint64_t> {
          // TLS: the records already read (or readable now) decrypted into the block.
          absl::StatusOr<size_t> r = conn.ssl() != nullptr
                                         ? TlsRecvNow(conn.ssl(), block + done, block_bytes - done)
                                         : RecvNow(conn.fd(), block + done, block_bytes - done);
          if (!r.ok()) return r.status();
          got = *r;
          return got;
        },
        generation);
    if (!s.ok()) return s;
    empty = conn.ssl() == nullptr ? done + got < block_bytes : got == 0;
    done += got;
  }
  return absl::OkStatus();
}

}  // namespace kvcm
