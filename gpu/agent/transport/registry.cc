#include "gpu/agent/transport/registry.h"

#include <cstddef>

#include "absl/strings/str_cat.h"
#include "gpu/agent/transport/nccl/nccl_transport.h"
#include "gpu/agent/transport/tcp/tcp_transport.h"

namespace kvcm {
namespace {

// One entry per row of kTransportDescriptions, in its order.
constexpr TransportEntry kTransports[] = {
    {.name = "tcp", .create = &CreateTcpTransport, .validate = nullptr},
    {.name = "nccl", .create = &CreateNcclTransport, .validate = &ValidateNcclTransportOptions},
};

constexpr bool MatchesTheTable() {
  if (std::size(kTransports) != std::size(kTransportDescriptions)) return false;
  for (size_t i = 0; i < std::size(kTransports); ++i) {
    if (kTransports[i].name != kTransportDescriptions[i].name) return false;
  }
  return true;
}
static_assert(MatchesTheTable(),
              "kTransports must list the rows of common/transports.h, in order, once each");

}  // namespace

std::span<const TransportEntry> RegisteredTransports() { return kTransports; }

absl::StatusOr<const TransportEntry*> FindTransport(absl::string_view name,
                                                    absl::string_view field) {
  absl::StatusOr<const TransportDescription*> row = LookupTransport(name, field);
  if (!row.ok()) return row.status();
  return &kTransports[*row - kTransportDescriptions];
}

}  // namespace kvcm
