// RpcRunner: what every unary handler of the manager's services does around its body,
// written once: time it, convert its absl::Status to a grpc::Status (same code and message),
// record the RPC metrics, log failures at a bounded rate, and finish on the context's
// default reactor.
//
// Thread-safe: handlers run concurrently; ServiceMetrics and LogRateLimiter are.
#ifndef KVCM_SERVER_SERVICE_UNARY_RPC_H_
#define KVCM_SERVER_SERVICE_UNARY_RPC_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "server/service/metrics.h"

namespace kvcm {

class RpcRunner {
 public:
  // `metrics` is not owned and must outlive the runner.
  explicit RpcRunner(ServiceMetrics* metrics);

  // Runs `body` (returning absl::Status) and finishes the call with its outcome.
  template <typename Body>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, Rpc rpc, Body&& body) {
    const auto start = std::chrono::steady_clock::now();
    const absl::Status status = std::forward<Body>(body)();
    metrics_->RecordRpc(rpc, status.code(),
                        absl::FromChrono(std::chrono::steady_clock::now() - start));
    if (!status.ok()) LogFailure(rpc, status);
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  }

  // Logs a failed call: an error when the server is at fault, a warning otherwise.
  void LogFailure(Rpc rpc, const absl::Status& status);

  ServiceMetrics* metrics() const { return metrics_; }

 private:
  ServiceMetrics* const metrics_;
  LogRateLimiter error_log_;
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_UNARY_RPC_H_
