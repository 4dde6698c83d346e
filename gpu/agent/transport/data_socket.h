// The socket side of the agents' data connection (agent.proto, above PullBlocksRequest):
// addresses, blocking I/O with the transfer's io timeout, length-prefixed frames, and the
// header that carries a status; in plaintext, or through the connection's TLS session
// (data_tls.h). Shared by the TCP data path (tcp_transport.cc) and the link data path
// (link_transfer.cc). Free functions; thread-compatible per connection.
#ifndef KVCM_GPU_AGENT_TRANSPORT_DATA_SOCKET_H_
#define KVCM_GPU_AGENT_TRANSPORT_DATA_SOCKET_H_

#include <netinet/in.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"
#include "kvcm/v1/agent.pb.h"

struct ssl_st;

namespace kvcm {

// One end of a data connection: its socket and, on a TLS data port, the TLS session over
// it (made by DataTls), through which the functions below read and write. Owns the session,
// not the socket: close the socket after the DataConn is gone. Move-only; one thread at a
// time (another may shutdown() the socket to wake it).
class DataConn {
 public:
  // Plaintext over `fd`.
  explicit DataConn(int fd) : fd_(fd) {}
  // TLS over `fd` through `ssl`, which this takes ownership of.
  DataConn(int fd, ssl_st* ssl) : fd_(fd), ssl_(ssl) {}

  int fd() const { return fd_; }
  // Null in plaintext.
  ssl_st* ssl() const { return ssl_.get(); }

 private:
  struct SslFree {
    void operator()(ssl_st* ssl) const;  // data_tls.cc
  };
  int fd_;
  std::unique_ptr<ssl_st, SslFree> ssl_;
};

// Tags in front of each block (or chunk of blocks) of a served pull.
inline constexpr uint8_t kTagBlock = 1;      // bytes_per_block raw bytes follow
inline constexpr uint8_t kTagError = 2;      // a frame with a PullBlocksHeader error follows
inline constexpr uint8_t kTagLinkChunk = 3;  // a 4-byte block count; the bytes go on the link

// "a.b.c.d:port" -> sockaddr; INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<sockaddr_in> ParseAddress(absl::string_view address, absl::string_view field);

// UNAVAILABLE with errno's text.
absl::Status Errno(absl::string_view what);

// Blocking I/O on a socket with SO_RCVTIMEO / SO_SNDTIMEO set (SetSocketOptions): a peer
// silent for the timeout fails the call (DEADLINE_EXCEEDED), a closed or reset one
// UNAVAILABLE.
absl::Status SendAll(DataConn& conn, const void* data, size_t n);
absl::Status RecvAll(DataConn& conn, void* data, size_t n);

// A 4-byte little-endian length and the serialized message. RecvFrame refuses frames over
// 16 MiB and malformed ones (INVALID_ARGUMENT).
absl::Status SendFrame(DataConn& conn, const google::protobuf::MessageLite& message);
absl::Status RecvFrame(DataConn& conn, google::protobuf::MessageLite* message);

// Send / receive timeouts of `io_timeout_ms` and TCP_NODELAY.
void SetSocketOptions(int fd, uint32_t io_timeout_ms);

// OK while the peer keeps the connection open; UNAVAILABLE once it closed or reset it
// (looks at the socket without waiting and without consuming bytes).
absl::Status CheckPeerOpen(const DataConn& conn);

// A header carrying `status`, and the status a header carries (a code outside
// google.rpc.Code becomes UNKNOWN; the message is prefixed "peer: ").
v1::PullBlocksHeader HeaderOf(const absl::Status& status, uint64_t bytes_per_block);
absl::Status StatusOf(const v1::PullBlocksHeader& header);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_DATA_SOCKET_H_
