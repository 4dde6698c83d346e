// The transports a kvcm-agent may register with, described once for every process: the name
// --transport takes and RegisterAgentRequest.transport says, its help text, the link
// bandwidth the manager's Route assumes for an agent that has not measured its pulls, and
// whether its links are bootstrapped through the manager (AgentControl.NcclBootstrap).
//
// The manager validates registrations, costs links and relays bootstraps from this table;
// the agent's factories (gpu/agent/transport/registry.cc) are keyed by it. Adding a
// transport: one row here, its folder under gpu/agent/transport/ and its factory there.
//
// constexpr data and pure functions; thread-safe.
#ifndef KVCM_COMMON_TRANSPORTS_H_
#define KVCM_COMMON_TRANSPORTS_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcm {

struct TransportDescription {
  absl::string_view name;     // what --transport takes and RegisterAgentRequest.transport says
  absl::string_view summary;  // for --help and errors
  // Link bandwidth, Gbit/s, of an agent of this transport that has not measured its pulls
  // yet (Route's cost model; the manager's route_<name>_link_gbps overrides it where it
  // has one). >= 1.
  uint32_t default_link_gbps;
  // Whether its links are bootstrapped through the manager (NcclBootstrapRelay).
  bool uses_bootstrap_relay;
};

// Every transport, the default first, in the order --help lists them.
inline constexpr TransportDescription kTransportDescriptions[] = {
    {.name = "tcp",
     .summary = "the data port's sockets (TLS 1.3 unless insecure); any host",
     .default_link_gbps = 25,  // a datacentre NIC
     .uses_bootstrap_relay = false},
    {.name = "nccl",
     .summary = "NCCL links between GPUs, bootstrapped through the manager; CUDA pools only",
     .default_link_gbps = 400,  // NVLink or InfiniBand
     .uses_bootstrap_relay = true},
};

// The transport an agent with a data port and no transport named runs.
inline constexpr absl::string_view kDefaultTransport = kTransportDescriptions[0].name;

// The row named `name` (exact case); nullptr when there is none.
constexpr const TransportDescription* FindTransportDescription(absl::string_view name) {
  for (const TransportDescription& t : kTransportDescriptions) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// default_link_gbps of the row named `name`; 0 when there is none.
constexpr uint32_t DefaultLinkGbps(absl::string_view name) {
  const TransportDescription* t = FindTransportDescription(name);
  return t == nullptr ? 0 : t->default_link_gbps;
}

// The row named `name`; INVALID_ARGUMENT "<field> must be one of tcp, nccl; got \"x\"".
absl::StatusOr<const TransportDescription*> LookupTransport(absl::string_view name,
                                                            absl::string_view field = "transport");

// Whether the transport named `name` bootstraps its links through the manager; false for
// an unknown name.
bool UsesBootstrapRelay(absl::string_view name);

// "tcp, nccl": the names, in table order.
std::string TransportNames();

// "tcp (the data port's ...), nccl (NCCL links ...)": for --transport's help.
std::string TransportHelp();

}  // namespace kvcm

#endif  // KVCM_COMMON_TRANSPORTS_H_
