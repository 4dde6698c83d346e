#include "gpu/agent/transport/registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpu/agent/transport/nccl/nccl_transport.h"
#include "gpu/agent/transport/tcp/tcp_transport.h"

namespace kvcm {
namespace {

constexpr TransportEntry kTransports[] = {
    {.name = "tcp",
     .summary = "the data port's sockets (TLS 1.3 unless insecure); any host",
     .create = &CreateTcpTransport,
     .validate = nullptr},
    {.name = "nccl",
     .summary = "NCCL links between GPUs, bootstrapped through the manager; CUDA pools only",
     .create = &CreateNcclTransport,
     .validate = &ValidateNcclTransportOptions},
};

}  // namespace

std::span<const TransportEntry> RegisteredTransports() { return kTransports; }

absl::StatusOr<const TransportEntry*> FindTransport(absl::string_view name,
                                                    absl::string_view field) {
  for (const TransportEntry& entry : kTransports) {
    if (entry.name == name) return &entry;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, " must be one of ",
      absl::StrJoin(
          kTransports, ", ",
          [](std::string* out, const TransportEntry& e) { absl::StrAppend(out, e.name); }),
      "; got \"", name, "\""));
}

}  // namespace kvcm
