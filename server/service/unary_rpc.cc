#include "server/service/unary_rpc.h"

#include <string>

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

RpcRunner::RpcRunner(ServiceMetrics* metrics)
    : metrics_(metrics), error_log_(kFailureLogLines, kFailureLogPeriod) {}

void RpcRunner::LogFailure(Rpc rpc, const absl::Status& status) {
  error_log_.Log(IsServerFault(status.code()) ? LogSeverity::kError : LogSeverity::kWarning,
                 absl::StrCat(RpcName(rpc), " failed: ", status.ToString()));
}

}  // namespace kvcm
