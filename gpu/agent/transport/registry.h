// The transports a kvcm-agent can run: the factory of each row of common/transports.h (its
// name, help and what the manager assumes of it). A transport lives in a folder of its own
// under gpu/agent/transport/ and exports a factory and a check of the options it reads;
// registry.cc lists them, once, by the table's names. The agent creates its transport by
// name and never names one in code.
//
// Adding a transport: its folder (header, source, CMakeLists.txt, tests), one row in
// common/transports.h, one add_subdirectory in transport/CMakeLists.txt and one entry in
// registry.cc.
#ifndef KVCM_GPU_AGENT_TRANSPORT_REGISTRY_H_
#define KVCM_GPU_AGENT_TRANSPORT_REGISTRY_H_

#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/transports.h"
#include "common/types.h"
#include "gpu/agent/pool/agent_state.h"
#include "gpu/agent/pool/pool_geometry.h"
#include "gpu/agent/transport/data_port.h"
#include "gpu/agent/transport/transport.h"

namespace kvcm {

struct AgentOptions;

// What a factory gets. Everything is the agent's and outlives the transport.
struct TransportContext {
  // The agent's options: each transport reads its own (nccl_*), and agent_id, device_index.
  const AgentOptions* options = nullptr;
  // The data port every transport serves.
  TcpTransportOptions data;
  AgentPools pools;
  Tier main_tier = Tier::kGpu;
  // Whether the main pool is in device memory, and where it is ("host memory (...)"), for
  // transports that need a GPU to say why they cannot run.
  bool pool_on_device = false;
  std::string pool_memory;
  // Sends a link offer to a peer through the manager (transports with links of their own).
  LinkBootstrapFn bootstrap_link;
};

struct TransportEntry {
  absl::string_view name;  // its row's name in kTransportDescriptions
  // Starts the transport (it listens at once). FAILED_PRECONDITION when this build or this
  // machine cannot run it, naming why and the alternative.
  absl::StatusOr<std::unique_ptr<Transport>> (*create)(const TransportContext& context);
  // Checks the options it reads against the pool's geometry: INVALID_ARGUMENT naming the
  // field. Null: it reads none beyond the data port's.
  absl::Status (*validate)(const AgentOptions& options, const PoolGeometry& geometry);
};

// Every transport, in the order of kTransportDescriptions (each row has exactly one entry;
// registry.cc checks that when it compiles).
std::span<const TransportEntry> RegisteredTransports();

// The transport named `name`; INVALID_ARGUMENT naming `field` and the table's names.
absl::StatusOr<const TransportEntry*> FindTransport(absl::string_view name,
                                                    absl::string_view field = "transport");

}  // namespace kvcm

#endif  // KVCM_GPU_AGENT_TRANSPORT_REGISTRY_H_
