// LocalSocketServer: the endpoint of the agent's local data path (--local_socket): a Unix
// socket of type SOCK_SEQPACKET (one message per datagram, file descriptors passed as
// SCM_RIGHTS), created with mode 0600 (0660 in socket_group), where engines on this host open
// LocalSessions (local_session.h). A connection is admitted by its peer's SO_PEERCRED
// credentials (allowed_uids / allowed_gids; by default the agent's own uid only), at most
// max_sessions at once and max_sessions_per_uid from one uid; any other is closed as it is
// accepted (kvcm_agent_local_sessions_total{result}). Each is served by its own thread and
// closed when its hello has not registered a region within hello_timeout_ms, or when its
// session ends (a revoked token). Nothing a peer sends can stop the server: a request too
// long, that does not parse or carries stray descriptors gets an error reply and the
// connection stays open; a peer that hangs up ends its session only.
//
// Thread-safe: Stop may be called from any thread, more than once.
#ifndef KVCM_GPU_AGENT_LOCAL_LOCAL_SOCKET_SERVER_H_
#define KVCM_GPU_AGENT_LOCAL_LOCAL_SOCKET_SERVER_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gpu/agent/local/local_session.h"

namespace kvcm {

struct LocalSocketOptions {
  // Where to listen. A socket already there (a previous agent's) is replaced; any other file
  // is FAILED_PRECONDITION. 1..107 bytes.
  std::string path;
  // Sessions served at once. >= 1.
  uint32_t max_sessions = 64;
  // Connections one peer uid may hold at once (awaiting a hello or in session). >= 1.
  uint32_t max_sessions_per_uid = 16;
  // Peers admitted: uid in allowed_uids or primary gid in allowed_gids; both empty: the
  // agent's effective uid only.
  std::vector<uint32_t> allowed_uids;
  std::vector<uint32_t> allowed_gids;
  // The socket file's group, a name or a number: mode 0660 in it. Empty: mode 0600.
  std::string socket_group;
  // A connection whose hello has not registered a region within this is closed. >= 1.
  uint32_t hello_timeout_ms = 2'000;
  // Principals bound to peer uids (LocalSessionEnv::principal_uids).
  LocalPrincipalUids principal_uids;
};

class LocalSocketServer {
 public:
  // Listens at options.path and serves sessions over `env` until Stop. INVALID_ARGUMENT for
  // bad options; FAILED_PRECONDITION for a path held by a file that is not a socket;
  // UNAVAILABLE when the socket cannot be made or bound.
  static absl::StatusOr<std::unique_ptr<LocalSocketServer>> Start(LocalSocketOptions options,
                                                                  LocalSessionEnv env);
  ~LocalSocketServer();  // Stop()
  LocalSocketServer(const LocalSocketServer&) = delete;
  LocalSocketServer& operator=(const LocalSocketServer&) = delete;

  // Stops accepting, ends every session (their threads joined) and removes the socket file.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  const std::string& path() const { return options_.path; }
  // Sessions being served now.
  uint32_t active_sessions() const ABSL_LOCKS_EXCLUDED(mu_);
  // Connections closed as accepted so far: over max_sessions or max_sessions_per_uid, or of
  // a peer not admitted.
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  struct Connection {
    int fd = -1;
    uint32_t uid = 0;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  LocalSocketServer(LocalSocketOptions options, LocalSessionEnv env, int listen_fd, int wake_fd);
  void AcceptLoop();
  // Serves one connection until the peer hangs up or Stop; sets conn->done.
  void Serve(Connection* conn, std::string peer);
  // Whether a peer of `uid` and `gid` may connect.
  bool Admitted(uint32_t uid, uint32_t gid) const;
  // Closes a connection accepted from `peer`, counted as `result`, logging `why`.
  void Refuse(int fd, absl::string_view result, const std::string& peer, absl::string_view why);
  // Joins the threads of sessions that ended.
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LocalSocketOptions options_;
  const LocalSessionEnv env_;
  const int listen_fd_;
  const int wake_fd_;  // an eventfd: readable once Stop began, for every poll
  std::thread acceptor_;
  std::atomic<uint64_t> refused_{0};
  mutable absl::Mutex mu_;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_LOCAL_LOCAL_SOCKET_SERVER_H_
