// EtcdClient: the few etcd v3 calls kvcm-manager's leader election needs, over etcd's own
// gRPC API (proto/etcd, wire-compatible subset) with the Debian gRPC stack: lease grant,
// keep-alive and revoke, a create-if-absent transaction, a read, and a watch for a key's
// deletion.
//
// Several endpoints are tried in turn: a call that fails UNAVAILABLE or DEADLINE_EXCEEDED
// moves the client to the next endpoint for the calls after it. Every call takes a
// deadline; errors are the gRPC status as absl::Status, prefixed with the etcd operation.
//
// Thread-safe. Cancel() ends a WaitForDelete in flight (and any later one) with CANCELLED.
#ifndef KVCM_SERVER_HA_ETCD_CLIENT_H_
#define KVCM_SERVER_HA_ETCD_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security_options.h"
#include "etcd/rpc.grpc.pb.h"

namespace kvcm {

class EtcdClient {
 public:
  // A client of the etcd members at `endpoints` (host:port, at least one), over TLS when
  // tls.insecure is false. INVALID_ARGUMENT for no endpoint or bad TLS files (naming them).
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(std::vector<std::string> endpoints,
                                                            const TlsOptions& tls);

  struct Lease {
    int64_t id = 0;
    // The time to live etcd granted (it may raise a short one to its minimum).
    absl::Duration ttl;
  };
  // A new lease of `ttl` (whole seconds, at least one).
  absl::StatusOr<Lease> Grant(absl::Duration ttl, absl::Time deadline);
  // One keep-alive of `lease`: the time to live etcd restarted it with. NOT_FOUND when the
  // lease has already expired or was revoked.
  absl::StatusOr<absl::Duration> KeepAlive(int64_t lease, absl::Time deadline);
  // Revokes `lease`, deleting the keys attached to it.
  absl::Status Revoke(int64_t lease, absl::Time deadline);

  struct Key {
    bool exists = false;
    std::string value;
    int64_t lease = 0;
    // etcd's store revision when the answer was read: a watch from revision + 1 misses
    // nothing that happened after it.
    int64_t revision = 0;
  };
  // Puts `key` = `value` attached to `lease` if the key does not exist, atomically (one
  // transaction). Returns whether it did, and the key as it is after the transaction.
  struct CreateResult {
    bool created = false;
    Key key;
  };
  absl::StatusOr<CreateResult> CreateIfAbsent(const std::string& key, const std::string& value,
                                              int64_t lease, absl::Time deadline);
  absl::StatusOr<Key> Get(const std::string& key, absl::Time deadline);

  // Blocks until `key` is deleted at a revision after `after_revision` (OK), the deadline
  // passes (DEADLINE_EXCEEDED), Cancel() is called (CANCELLED) or the watch fails.
  absl::Status WaitForDelete(const std::string& key, int64_t after_revision, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);

  // The endpoint the next call goes to.
  std::string endpoint() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Member {
    std::string endpoint;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
    std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  };
  explicit EtcdClient(std::vector<Member> members) : members_(std::move(members)) {}

  Member& Current() ABSL_LOCKS_EXCLUDED(mu_);
  // `status` as absl::Status prefixed with `op` and the endpoint; moves on to the next
  // endpoint when the member looks unreachable.
  absl::Status Fail(absl::string_view op, const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<Member> members_;
  mutable absl::Mutex mu_;
  size_t current_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* watching_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_HA_ETCD_CLIENT_H_
