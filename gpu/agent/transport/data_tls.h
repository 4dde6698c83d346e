// TLS of the agents' data port (tcp_transport.h), with OpenSSL over the connected socket:
// TLS 1.3, and both ends present a certificate and verify the other's against the cluster
// CA (mutual TLS). A peer is authenticated as a holder of a certificate that CA signed; its
// name and address are not checked (data addresses come from the manager, which only trusts
// agents over mTLS itself). The handshake and every read and write keep the socket's io
// timeout (SO_RCVTIMEO / SO_SNDTIMEO): a silent peer is DEADLINE_EXCEEDED.
//
// The certificate, key and CA files are re-read when their size or mtime changes, looked
// at no more often than every reload_interval_s; a change that does not load (a half-written
// pair) keeps the previous context and is retried at the next look.
//
// Thread-safe: Accept and Connect may run concurrently on different sockets.
#ifndef KVCM_GPU_AGENT_TRANSPORT_DATA_TLS_H_
#define KVCM_GPU_AGENT_TRANSPORT_DATA_TLS_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security_options.h"
#include "gpu/agent/transport/data_socket.h"

struct ssl_ctx_st;

namespace kvcm {

class DataTls {
 public:
  // Loads `tls`: cert_file, key_file and ca_file are all required (INVALID_ARGUMENT naming
  // the field, or as TlsOptions::CheckFiles for files that do not load).
  static absl::StatusOr<std::shared_ptr<DataTls>> Create(const TlsOptions& tls);
  ~DataTls();
  DataTls(const DataTls&) = delete;
  DataTls& operator=(const DataTls&) = delete;

  // The handshake on connected socket `fd` as the server (Accept) or the client (Connect),
  // under the socket's io timeouts. The connection reads and writes through the session;
  // it does not own `fd`. UNAVAILABLE when either end refuses the other (naming why),
  // DEADLINE_EXCEEDED when the peer goes silent.
  absl::StatusOr<DataConn> Accept(int fd) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<DataConn> Connect(int fd) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit DataTls(TlsOptions tls);
  // The current context, reloaded first when the files changed and the interval passed.
  std::shared_ptr<ssl_ctx_st> Context() ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<DataConn> Handshake(int fd, bool server);

  const TlsOptions tls_;
  absl::Mutex mu_;
  std::shared_ptr<ssl_ctx_st> ctx_ ABSL_GUARDED_BY(mu_);
  std::string stamp_ ABSL_GUARDED_BY(mu_);  // the files' sizes and mtimes when loaded
  absl::Time next_look_ ABSL_GUARDED_BY(mu_);
};

// A TLS session's blocking writes and reads of whole buffers, for SendAll / RecvAll
// (data_socket.h), with their codes: DEADLINE_EXCEEDED at the socket's io timeout,
// UNAVAILABLE when the peer closed or the session failed.
absl::Status TlsSendAll(ssl_st* ssl, const void* data, size_t n);
absl::Status TlsRecvAll(ssl_st* ssl, void* data, size_t n);

// Over a socket set non-blocking (O_NONBLOCK): the plaintext bytes, at most `n`, that the
// session can return without waiting (0 when it needs more from the network: poll the
// socket for reading, then call again). Errors as TlsRecvAll.
absl::StatusOr<size_t> TlsRecvNow(ssl_st* ssl, void* data, size_t n);

// Over a socket set non-blocking: the bytes of `data` (at most one record's) encrypted and
// taken into the session's write buffer or the socket without waiting; 0 when there is no
// room: poll the socket for writing, then call again with the same `data` and `n` (a record
// may wait half-written). TlsFlushNow puts what is buffered on the wire: false when the
// socket has no room yet (poll, call again). Errors as TlsSendAll.
absl::StatusOr<size_t> TlsSendNow(ssl_st* ssl, const void* data, size_t n);
absl::StatusOr<bool> TlsFlushNow(ssl_st* ssl);

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_DATA_TLS_H_
