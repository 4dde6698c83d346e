// RpcRunner: what every gRPC handler of a kvcm server does around its body, written once for
// the manager's and the agent's services: time it, convert its absl::Status to a grpc::Status
// (same code and message), record the outcome through an RpcMetricsRecorder, log failures at a
// bounded rate, and (for a unary call) finish on the context's default reactor.
//
// RpcId is a server's enum of its RPCs; `absl::string_view RpcName(RpcId)` must be declared
// in the enum's namespace (found by argument-dependent lookup). Thread-safe: handlers run
// concurrently; the recorder must be, and RpcFailureLog is.
#ifndef KVCM_COMMON_RPC_RUNNER_H_
#define KVCM_COMMON_RPC_RUNNER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/log.h"

namespace kvcm {

// Where RpcRunner reports finished calls; each server's metrics class implements it.
template <typename RpcId>
class RpcMetricsRecorder {
 public:
  virtual ~RpcMetricsRecorder() = default;
  // One finished unary call that took `latency` from decode to reply.
  virtual void RecordRpc(RpcId rpc, absl::StatusCode code, absl::Duration latency) = 0;
  // One finished streaming call.
  virtual void RecordStreamEnd(RpcId rpc, absl::StatusCode code) = 0;
};

// Bucket boundaries in seconds of every kvcm RPC latency histogram: 25 us .. 2.5 s (an
// in-process Match takes about 1 us, a loopback RPC tens of microseconds).
const std::vector<double>& RpcLatencyBucketsSeconds();

// Logs failed calls: an error when the server is at fault (INTERNAL, UNKNOWN, DATA_LOSS,
// UNIMPLEMENTED), a warning otherwise; at most 20 lines per 10 s. Thread-safe.
class RpcFailureLog {
 public:
  RpcFailureLog();
  void Log(absl::string_view rpc_name, const absl::Status& status);

 private:
  LogRateLimiter log_;
};

template <typename RpcId>
class RpcRunner {
 public:
  // `metrics` is not owned and must outlive the runner.
  explicit RpcRunner(RpcMetricsRecorder<RpcId>* metrics) : metrics_(metrics) {}

  // Runs `body` (returning absl::Status) and finishes the call with its outcome.
  template <typename Body>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, RpcId rpc, Body&& body) {
    const auto start = std::chrono::steady_clock::now();
    const absl::Status status = std::forward<Body>(body)();
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    Finish(reactor, rpc, start, status);
    return reactor;
  }

  // For a body that answers later: runs `body(finish)`, where `finish` (a copyable
  // std::function<void(const absl::Status&)>) must be called exactly once, inline or from
  // any thread, after the response message is filled in.
  template <typename Body>
  grpc::ServerUnaryReactor* UnaryAsync(grpc::CallbackServerContext* ctx, RpcId rpc, Body&& body) {
    const auto start = std::chrono::steady_clock::now();
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    std::forward<Body>(body)(std::function<void(const absl::Status&)>(
        [this, reactor, rpc, start](const absl::Status& status) {
          Finish(reactor, rpc, start, status);
        }));
    return reactor;
  }

  // A streaming call ends with `status`: records it, logs it unless OK or CANCELLED (the
  // client went away), and returns what the reactor should Finish with.
  grpc::Status StreamEnd(RpcId rpc, const absl::Status& status) {
    metrics_->RecordStreamEnd(rpc, status.code());
    if (!status.ok() && status.code() != absl::StatusCode::kCancelled) LogFailure(rpc, status);
    return ToGrpcStatus(status);
  }

  void LogFailure(RpcId rpc, const absl::Status& status) { failures_.Log(RpcName(rpc), status); }

 private:
  void Finish(grpc::ServerUnaryReactor* reactor, RpcId rpc,
              std::chrono::steady_clock::time_point start, const absl::Status& status) {
    metrics_->RecordRpc(rpc, status.code(),
                        absl::FromChrono(std::chrono::steady_clock::now() - start));
    if (!status.ok()) LogFailure(rpc, status);
    reactor->Finish(ToGrpcStatus(status));
  }

  RpcMetricsRecorder<RpcId>* const metrics_;
  RpcFailureLog failures_;
};

}  // namespace kvcm

#endif  // KVCM_COMMON_RPC_RUNNER_H_
