// RouteHandler: the body of CacheManager.Route without gRPC (validation, the live
// candidates with their link bandwidth, one probe match, the core's RankAgents, the pin for
// the chosen agent, the response). CacheManagerService runs it in its handler; the fuzz
// harness calls it directly, so both run the same code.
//
// Thread-safe: the index and registry are; the round-robin step is atomic.
#ifndef KVCM_SERVER_SERVICE_ROUTE_HANDLER_H_
#define KVCM_SERVER_SERVICE_ROUTE_HANDLER_H_

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvcm/v1/cache_manager.pb.h"
#include "server/core/agent_registry.h"
#include "server/core/cache_index.h"
#include "server/core/engine_sessions.h"
#include "server/core/router.h"
#include "server/service/proto_convert.h"

namespace kvcm {

// Route's cost model where requests and agents say nothing (ServerOptions route_*).
struct RouteDefaults {
  double prefill_tokens_per_s = 10'000;
  // Link bandwidth, Gbit/s, of an agent that has not measured its pulls, by its transport's
  // name; a transport not here costs its row's default_link_gbps (common/transports.h).
  absl::flat_hash_map<std::string, double> link_gbps;
};

class RouteHandler {
 public:
  // Not owned; all must outlive the handler. `agents` and `engines` may be null (no agent,
  // or no engine, is live then).
  RouteHandler(CacheIndex* index, const AgentRegistry* agents, const EngineSessions* engines,
               RequestLimits limits, RouteDefaults defaults);

  // Fills `resp` as CacheManager.Route documents; its errors change nothing.
  absl::Status Route(const v1::RouteRequest& req, v1::RouteResponse* resp);

 private:
  // The live agents and engines to choose from, with their link bandwidth (0 for an engine:
  // it cannot fetch): `named` in order, or every live agent and engine by id when `named`
  // is empty. Engines are those of `tenant` only: another tenant's engine is answered as an
  // id nobody uses, so Route tells no one which engine ids exist. NOT_FOUND naming
  // candidates[i] for an id that is neither a live agent nor a live engine of `tenant`;
  // FAILED_PRECONDITION when none is live.
  absl::StatusOr<std::vector<RouteCandidate>> Candidates(
      std::span<const RouteCall::Candidate> named, absl::string_view tenant) const;
  // The link bandwidth Route assumes for an agent of `transport` with no measurement; an
  // agent with no transport (no data port) costs as the default transport.
  double UnmeasuredLinkGbps(absl::string_view transport) const;

  CacheIndex* const index_;
  const AgentRegistry* const agents_;
  const EngineSessions* const engines_;
  const RequestLimits limits_;
  const RouteDefaults defaults_;
  // Round-robin step: one per non-probe call.
  std::atomic<uint64_t> sequence_{0};
};

}  // namespace kvcm

#endif  // KVCM_SERVER_SERVICE_ROUTE_HANDLER_H_
