// The NCCL transport's registry entry, built with or without NCCL, so that --transport=nccl
// is always a known name whose refusal says why.
#include "absl/strings/str_cat.h"
#include "gpu/agent/agent_options.h"
#include "gpu/agent/transport/nccl/nccl_transport.h"

namespace kvcm {

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportContext& context) {
#ifndef KVCM_HAVE_NCCL
  return absl::FailedPreconditionError(
      "--transport=nccl: this kvcm-agent was built without NCCL (KVCM_NCCL_LIBRARY was not "
      "found at configure time); use --transport=tcp");
#else
  if (!context.pool_on_device) {
    return absl::FailedPreconditionError(
        absl::StrCat("--transport=nccl needs the pool on a CUDA device, but it is in ",
                     context.pool_memory, "; use --transport=tcp"));
  }
  const AgentOptions& o = *context.options;
  return MakeNcclTransport({.data = context.data,
                            .agent_id = o.agent_id,
                            .device = o.device_index,
                            .staging_bytes = o.nccl_staging_bytes,
                            .max_links = o.nccl_max_links,
                            .connect_timeout_ms = o.nccl_connect_timeout_ms},
                           context.pools, context.main_tier, context.bootstrap_link);
#endif
}

absl::Status ValidateNcclTransportOptions(const AgentOptions& options,
                                          const PoolGeometry& geometry) {
  if (options.nccl_staging_bytes < geometry.bytes_per_block()) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl_staging_bytes must hold at least one block (",
                     geometry.bytes_per_block(), " bytes), got ", options.nccl_staging_bytes));
  }
  return absl::OkStatus();
}

}  // namespace kvcm
