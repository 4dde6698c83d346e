// Authenticator: who is calling a kvcm gRPC server, from the `authorization: Bearer <token>`
// metadata and a tokens file (common/token_table.h) it re-reads when the file changes. The
// manager and the agent both authenticate with it; what a caller may then do is each
// server's own policy (server/service/access_control.h, gpu/agent/block_agent_access.h).
//
// Without a tokens file (the documented insecure dev mode) every caller is OpenPrincipal().
//
// Thread-safe.
#ifndef KVCM_COMMON_AUTHENTICATOR_H_
#define KVCM_COMMON_AUTHENTICATOR_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <ctime>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/token_table.h"

namespace kvcm {

class Authenticator {
 public:
  // Every caller is OpenPrincipal().
  static std::unique_ptr<Authenticator> Open();
  // Callers are the principals of the tokens file at `path`; its errors are returned.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(std::string path);

  // The caller of `ctx`, from its `authorization: Bearer <token>` metadata.
  absl::StatusOr<std::shared_ptr<const Principal>> Authenticate(
      const grpc::ServerContextBase& ctx) const ABSL_LOCKS_EXCLUDED(mu_);

  // Re-reads the tokens file when its modification time or size changed. A file that no
  // longer parses keeps the previous table (the error is returned, for the log): a typo must
  // not lock every caller out. Returns OK when nothing changed; no-op when open.
  absl::Status ReloadIfChanged() ABSL_LOCKS_EXCLUDED(mu_);

  bool open() const { return path_.empty(); }
  const std::string& path() const { return path_; }

 private:
  explicit Authenticator(std::string path) : path_(std::move(path)) {}

  const std::string path_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
  timespec mtime_ ABSL_GUARDED_BY(mu_) = {};
  off_t size_ ABSL_GUARDED_BY(mu_) = -1;
};

}  // namespace kvcm

#endif  // KVCM_COMMON_AUTHENTICATOR_H_
