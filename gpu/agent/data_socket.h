// The socket side of the agents' data connection (agent.proto, above PullBlocksRequest):
// addresses, blocking I/O with the transfer's io timeout, length-prefixed frames, and the
// header that carries a status. Shared by the TCP data path (tcp_transport.cc) and the
// link data path (link_transfer.cc). Free functions; thread-compatible per socket.
#ifndef KVCM_GPU_AGENT_DATA_SOCKET_H_
#define KVCM_GPU_AGENT_DATA_SOCKET_H_

#include <netinet/in.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"
#include "kvcm/v1/agent.pb.h"

namespace kvcm {

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
absl::Status SendAll(int fd, const void* data, size_t n);
absl::Status RecvAll(int fd, void* data, size_t n);

// A 4-byte little-endian length and the serialized message. RecvFrame refuses frames over
// 16 MiB and malformed ones (INVALID_ARGUMENT).
absl::Status SendFrame(int fd, const google::protobuf::MessageLite& message);
absl::Status RecvFrame(int fd, google::protobuf::MessageLite* message);

// Send / receive timeouts of `io_timeout_ms` and TCP_NODELAY.
void SetSocketOptions(int fd, uint32_t io_timeout_ms);

// OK while the peer keeps the connection open; UNAVAILABLE once it closed or reset it
// (looks without waiting and without consuming bytes).
absl::Status CheckPeerOpen(int fd);

// A header carrying `status`, and the status a header carries (a code outside
// google.rpc.Code becomes UNKNOWN; the message is prefixed "peer: ").
v1::PullBlocksHeader HeaderOf(const absl::Status& status, uint64_t bytes_per_block);
absl::Status StatusOf(const v1::PullBlocksHeader& header);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_DATA_SOCKET_H_
