// PrometheusRpcRecorder: the RpcMetricsRecorder of every kvcm server, over prometheus-cpp:
// <prefix>_requests_total{rpc,code} for every finished call and
// <prefix>_duration_seconds{rpc} for unary ones. Header-only, so that common/ does not link
// prometheus-cpp; the servers that use it do.
//
// Thread-safe: Record* may run concurrently from any thread, and with scrapes.
#ifndef KVCM_COMMON_RPC_METRICS_H_
#define KVCM_COMMON_RPC_METRICS_H_

#include <array>
#include <atomic>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/rpc_runner.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvcm {

// RpcId: a server's enum of its RPCs, 0..kNumRpcs-1, with RpcName (see RpcRunner).
template <typename RpcId, int kNumRpcs>
class PrometheusRpcRecorder final : public RpcMetricsRecorder<RpcId> {
 public:
  // Registers the two families in `registry` (not owned; must outlive the recorder).
  // `services` names the calls in the help text ("BlockAgent"); `streaming` says which RPCs
  // get no duration histogram. Every rpc starts with a zero OK counter, so rates start from
  // a zero sample.
  PrometheusRpcRecorder(prometheus::Registry& registry, const std::string& prefix,
                        const std::string& services, const std::function<bool(RpcId)>& streaming)
      : requests_(&prometheus::BuildCounter()
                       .Name(prefix + "_requests_total")
                       .Help("Finished " + services + " calls by rpc and status code.")
                       .Register(registry)) {
    prometheus::Family<prometheus::Histogram>& durations =
        prometheus::BuildHistogram()
            .Name(prefix + "_duration_seconds")
            .Help("Server-side time of unary " + services + " calls, decode to reply.")
            .Register(registry);
    for (int i = 0; i < kNumRpcs; ++i) {
      const RpcId rpc = static_cast<RpcId>(i);
      if (!streaming(rpc)) {
        duration_by_rpc_[i] =
            &durations.Add({{"rpc", std::string(RpcName(rpc))}}, RpcLatencyBucketsSeconds());
      }
      RequestCounter(rpc, absl::StatusCode::kOk);
    }
  }

  void RecordRpc(RpcId rpc, absl::StatusCode code, absl::Duration latency) override {
    RequestCounter(rpc, code).Increment();
    if (prometheus::Histogram* h = duration_by_rpc_[static_cast<int>(rpc)]; h != nullptr) {
      h->Observe(absl::ToDoubleSeconds(latency));
    }
  }

  void RecordStreamEnd(RpcId rpc, absl::StatusCode code) override {
    RequestCounter(rpc, code).Increment();
  }

 private:
  static constexpr int kNumCodes = 17;  // absl::StatusCode 0..16

  prometheus::Counter& RequestCounter(RpcId rpc, absl::StatusCode code) {
    int c = static_cast<int>(code);
    if (c < 0 || c >= kNumCodes) c = static_cast<int>(absl::StatusCode::kUnknown);
    std::atomic<prometheus::Counter*>& slot = request_by_code_[static_cast<int>(rpc)][c];
    prometheus::Counter* counter = slot.load(std::memory_order_acquire);
    if (counter == nullptr) {
      counter =
          &requests_->Add({{"rpc", std::string(RpcName(rpc))},
                           {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(c))}});
      slot.store(counter, std::memory_order_release);
    }
    return *counter;
  }

  prometheus::Family<prometheus::Counter>* const requests_;
  std::array<prometheus::Histogram*, kNumRpcs> duration_by_rpc_{};
  // Counters by (rpc, code), created on first use; Family::Add returns the same counter for
  // the same labels, so a race only stores an equal pointer twice.
  std::array<std::array<std::atomic<prometheus::Counter*>, kNumCodes>, kNumRpcs> request_by_code_{};
};

}  // namespace kvcm

#endif  // KVCM_COMMON_RPC_METRICS_H_
