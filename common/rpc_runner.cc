#include "common/rpc_runner.h"

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

// At most this many failure lines per period reach the log; the rest are counted.
constexpr int kFailureLogLines = 20;
constexpr absl::Duration kFailureLogPeriod = absl::Seconds(10);

// Codes that mean the server, not the caller, is at fault.
bool IsServerFault(absl::StatusCode code) {
  return code == absl::StatusCode::kInternal || code == absl::StatusCode::kUnknown ||
         code == absl::StatusCode::kDataLoss || code == absl::StatusCode::kUnimplemented;
}

}  // namespace

const std::vector<double>& RpcLatencyBucketsSeconds() {
  static const auto* const kBuckets =
      new std::vector<double>{25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3,
                              10e-3, 25e-3, 50e-3,  100e-3, 250e-3, 1.0,  2.5};
  return *kBuckets;
}

RpcFailureLog::RpcFailureLog() : log_(kFailureLogLines, kFailureLogPeriod) {}

void RpcFailureLog::Log(absl::string_view rpc_name, const absl::Status& status) {
  log_.Log(IsServerFault(status.code()) ? LogSeverity::kError : LogSeverity::kWarning,
           absl::StrCat(rpc_name, " failed: ", status.ToString()));
}

}  // namespace kvcm
