// What a benchmark reads back from the metrics of an in-process ManagerServer.
#ifndef KVCM_BENCH_MANAGER_METRICS_H_
#define KVCM_BENCH_MANAGER_METRICS_H_

#include <utility>

#include "server/service/manager_server.h"

namespace kvcm::bench {

// kvcm_rpc_duration_seconds{rpc="Match"}: the service's own time in the Match handler
// (access check, validation, conversion, index), as (sum seconds, count) from the metrics
// text. Thread-safe, as ServiceMetrics is.
std::pair<double, double> MatchHandlerSeconds(ManagerServer& server);

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_MANAGER_METRICS_H_
