#include "gpu/agent/transport/data_tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace kvcm {
namespace {

// Bytes buffered between the session and the socket, each way. A record carries at most
// 16 KiB: unbuffered, a 4 MiB block would cost ~270 sends and twice as many receives, which
// on loopback costs as much as the cipher. (OpenSSL's read-ahead into a read buffer this
// large instead of a buffering BIO saves a copy but measured slower: kvcm_transfer_bench,
// docs/PERFORMANCE.md.)
constexpr int kSocketBufferBytes = 256 << 10;

// A BIO over the socket that sends with MSG_NOSIGNAL (OpenSSL's socket BIO uses write(),
// whose SIGPIPE would kill the process when a peer resets) and reports the socket's
// timeouts (EAGAIN) as retries, which the blocking session turns into WANT_READ/WRITE.
int FdOf(BIO* bio) { return static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(bio))); }

int BioWrite(BIO* bio, const char* data, int n) {
  BIO_clear_retry_flags(bio);
  while (true) {
    const ssize_t sent = send(FdOf(bio), data, static_cast<size_t>(n), MSG_NOSIGNAL);
    if (sent >= 0) return static_cast<int>(sent);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) BIO_set_retry_write(bio);
    return -1;
  }
}

int BioRead(BIO* bio, char* out, int n) {
  BIO_clear_retry_flags(bio);
  while (true) {
    const ssize_t got = recv(FdOf(bio), out, static_cast<size_t>(n), 0);
    if (got >= 0) return static_cast<int>(got);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) BIO_set_retry_read(bio);
    return -1;
  }
}

long BioCtrl(BIO*, int cmd, long, void*) {  // NOLINT(runtime/int): OpenSSL's signature
  return cmd == BIO_CTRL_FLUSH ? 1 : 0;
}

const BIO_METHOD* SocketMethod() {
  static const BIO_METHOD* const kMethod = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "kvcm data socket");
    BIO_meth_set_write(m, BioWrite);
    BIO_meth_set_read(m, BioRead);
    BIO_meth_set_ctrl(m, BioCtrl);
    return m;
  }();
  return kMethod;
}

// What a failed SSL call means for the transfer. A want-read/write on a blocking socket is
// its io timeout.
absl::Status SslFailure(SSL* ssl, int result, absl::string_view what) {
  const int error = SSL_get_error(ssl, result);
  switch (error) {
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE:
      ERR_clear_error();
      return absl::DeadlineExceededError(absl::StrCat(what, ": peer went silent"));
    case SSL_ERROR_ZERO_RETURN:
      ERR_clear_error();
      return absl::UnavailableError(absl::StrCat(what, ": peer closed the connection"));
    case SSL_ERROR_SYSCALL: {
      const int saved = errno;
      ERR_clear_error();
      return absl::UnavailableError(
          absl::StrCat(what, ": ", saved == 0 ? "peer closed the connection" : strerror(saved)));
    }
    default:
      return absl::UnavailableError(absl::StrCat(what, ": ", TakeOpenSslError()));
  }
}

// Size and mtime of each file, or "" for one that cannot be stat'ed.
std::string StampOf(const TlsOptions& tls) {
  std::string out;
  for (const std::string* path : {&tls.cert_file, &tls.key_file, &tls.ca_file}) {
    struct stat st {};
    if (stat(path->c_str(), &st) == 0) {
      absl::StrAppend(&out, st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, ";");
    } else {
      absl::StrAppend(&out, "-;");
    }
  }
  return out;
}

struct CtxFree {
  void operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }
};

// One context for both ends of every connection: TLS 1.3, this agent's certificate, and
// a peer certificate from the CA required in either role.
absl::StatusOr<std::shared_ptr<SSL_CTX>> LoadContext(const TlsOptions& tls) {
  if (absl::Status s = tls.CheckFiles(); !s.ok()) return s;
  ERR_clear_error();
  std::shared_ptr<SSL_CTX> ctx(SSL_CTX_new(TLS_method()), CtxFree());
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", TakeOpenSslError()));
  auto failed = [](absl::string_view field, const std::string& path) {
    return absl::InvalidArgumentError(absl::StrCat(field, " \"", path, "\": ", TakeOpenSslError()));
  };
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_3_VERSION);
  // AES-128-GCM first (both ends are ours): the fastest suite with AES-NI.
  SSL_CTX_set_ciphersuites(ctx.get(),
                           "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:"
                           "TLS_CHACHA20_POLY1305_SHA256");
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), tls.cert_file.c_str()) != 1) {
    return failed("cert_file", tls.cert_file);
  }
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(ctx.get()) != 1) {
    return failed("key_file", tls.key_file);
  }
  if (SSL_CTX_load_verify_locations(ctx.get(), tls.ca_file.c_str(), nullptr) != 1) {
    return failed("ca_file", tls.ca_file);
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  // No resumption: connections are few and long (one per pull), and tickets cost a write.
  SSL_CTX_set_session_cache_mode(ctx.get(), SSL_SESS_CACHE_OFF);
  SSL_CTX_set_num_tickets(ctx.get(), 0);
  // Every message of the data protocol has a known length, so a close without close_notify
  // cannot truncate one unnoticed; it reads as the peer closing, as in plaintext.
  SSL_CTX_set_options(ctx.get(), SSL_OP_IGNORE_UNEXPECTED_EOF | SSL_OP_NO_TICKET);
  return ctx;
}

}  // namespace

void DataConn::SslFree::operator()(ssl_st* ssl) const { SSL_free(ssl); }

absl::Status TlsSendAll(ssl_st* ssl, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    size_t sent = 0;
    const int result = SSL_write_ex(ssl, p, n, &sent);
    if (result <= 0) return SslFailure(ssl, result, "send");
    p += sent;
    n -= sent;
  }
  // The records wait in the write buffer until flushed: every send ends on the wire.
  BIO* out = SSL_get_wbio(ssl);
  if (BIO_flush(out) <= 0) {
    if (BIO_should_retry(out)) return absl::DeadlineExceededError("send: peer stopped reading");
    return absl::UnavailableError("send: peer closed the connection");
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> TlsSendNow(ssl_st* ssl, const void* data, size_t n) {
  size_t sent = 0;
  // Partial: the write returns once a record is out, so the caller bounds its lock hold.
  SSL_set_mode(ssl, SSL_MODE_ENABLE_PARTIAL_WRITE);
  const int result = SSL_write_ex(ssl, data, n, &sent);
  SSL_clear_mode(ssl, SSL_MODE_ENABLE_PARTIAL_WRITE);
  if (result > 0) return sent;
  const int error = SSL_get_error(ssl, result);
  if (error == SSL_ERROR_WANT_WRITE || error == SSL_ERROR_WANT_READ) {
    ERR_clear_error();
    return 0;
  }
  return SslFailure(ssl, result, "send");
}

absl::StatusOr<bool> TlsFlushNow(ssl_st* ssl) {
  BIO* out = SSL_get_wbio(ssl);
  if (BIO_flush(out) > 0) return true;
  if (BIO_should_retry(out)) return false;
  return absl::UnavailableError("send: peer closed the connection");
}

absl::StatusOr<size_t> TlsRecvNow(ssl_st* ssl, void* data, size_t n) {
  size_t got = 0;
  const int result = SSL_read_ex(ssl, data, n, &got);
  if (result > 0) return got;
  if (SSL_get_error(ssl, result) == SSL_ERROR_WANT_READ) {
    ERR_clear_error();
    return 0;
  }
  return SslFailure(ssl, result, "recv");
}

absl::Status TlsRecvAll(ssl_st* ssl, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    size_t got = 0;
    const int result = SSL_read_ex(ssl, p, n, &got);
    if (result <= 0) return SslFailure(ssl, result, "recv");
    p += got;
    n -= got;
  }
  return absl::OkStatus();
}

DataTls::DataTls(TlsOptions tls) : tls_(std::move(tls)) {}

DataTls::~DataTls() = default;

absl::StatusOr<std::shared_ptr<DataTls>> DataTls::Create(const TlsOptions& tls) {
  for (const auto& [field, path] :
       {std::pair{"cert_file", &tls.cert_file}, std::pair{"key_file", &tls.key_file},
        std::pair{"ca_file", &tls.ca_file}}) {
    if (path->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " is required: the data port is mutual TLS"));
    }
  }
  if (tls.reload_interval_s < 1) {
    return absl::InvalidArgumentError("reload_interval_s must be >= 1");
  }
  std::shared_ptr<DataTls> out(new DataTls(tls));
  const std::string stamp = StampOf(tls);
  absl::StatusOr<std::shared_ptr<SSL_CTX>> ctx = LoadContext(tls);
  if (!ctx.ok()) return ctx.status();
  absl::MutexLock lock(&out->mu_);
  out->ctx_ = *std::move(ctx);
  out->stamp_ = stamp;
  out->next_look_ = absl::Now() + absl::Seconds(tls.reload_interval_s);
  return out;
}

std::shared_ptr<SSL_CTX> DataTls::Context() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  if (now < next_look_) return ctx_;
  next_look_ = now + absl::Seconds(tls_.reload_interval_s);
  const std::string stamp = StampOf(tls_);
  if (stamp == stamp_) return ctx_;
  // Loaded under the lock: rare, and handshakes meanwhile wait for the new identity.
  absl::StatusOr<std::shared_ptr<SSL_CTX>> ctx = LoadContext(tls_);
  if (!ctx.ok()) {
    LogWarning(absl::StrCat("data port TLS: the certificate files changed but do not load (",
                            ctx.status().message(), "); keeping the previous ones"));
    return ctx_;
  }
  LogInfo("data port TLS: reloaded the certificate files");
  ctx_ = *std::move(ctx);
  stamp_ = stamp;
  return ctx_;
}

absl::StatusOr<DataConn> DataTls::Accept(int fd) { return Handshake(fd, /*server=*/true); }

absl::StatusOr<DataConn> DataTls::Connect(int fd) { return Handshake(fd, /*server=*/false); }

absl::StatusOr<DataConn> DataTls::Handshake(int fd, bool server) {
  const std::shared_ptr<SSL_CTX> ctx = Context();
  ERR_clear_error();
  SSL* ssl = SSL_new(ctx.get());  // holds its own reference to the context
  if (ssl == nullptr) return absl::InternalError(absl::StrCat("SSL_new: ", TakeOpenSslError()));
  DataConn conn(fd, ssl);
  BIO* socket = BIO_new(SocketMethod());
  BIO* buffered = BIO_new(BIO_f_buffer());
  if (socket == nullptr || buffered == nullptr ||
      BIO_set_buffer_size(buffered, kSocketBufferBytes) != 1) {
    BIO_free(socket);
    BIO_free(buffered);
    return absl::InternalError(absl::StrCat("BIO_new: ", TakeOpenSslError()));
  }
  BIO_set_data(socket, reinterpret_cast<void*>(static_cast<intptr_t>(fd)));
  BIO_set_init(socket, 1);
  // The session owns the chain (SSL_free frees both); OpenSSL flushes it after each
  // handshake flight and alert, TlsSendAll and TlsFlushNow after each send.
  BIO* chain = BIO_push(buffered, socket);
  SSL_set_bio(ssl, chain, chain);
  const int result = server ? SSL_accept(ssl) : SSL_connect(ssl);
  if (result != 1) {
    const long verify = SSL_get_verify_result(ssl);  // NOLINT(runtime/int)
    absl::Status s = SslFailure(ssl, result, "TLS handshake");
    if (verify != X509_V_OK) {
      return absl::Status(s.code(), absl::StrCat(s.message(), " (peer certificate: ",
                                                 X509_verify_cert_error_string(verify), ")"));
    }
    return s;
  }
  return conn;
}

}  // namespace kvcm
