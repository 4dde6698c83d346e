#include "common/transports.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcm {

absl::StatusOr<const TransportDescription*> LookupTransport(absl::string_view name,
                                                            absl::string_view field) {
  if (const TransportDescription* t = FindTransportDescription(name); t != nullptr) return t;
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be one of ", TransportNames(), "; got \"", name, "\""));
}

bool UsesBootstrapRelay(absl::string_view name) {
  const TransportDescription* t = FindTransportDescription(name);
  return t != nullptr && t->uses_bootstrap_relay;
}

std::string TransportNames() {
  return absl::StrJoin(
      kTransportDescriptions, ", ",
      [](std::string* out, const TransportDescription& t) { absl::StrAppend(out, t.name); });
}

std::string TransportHelp() {
  return absl::StrJoin(kTransportDescriptions, ", ",
                       [](std::string* out, const TransportDescription& t) {
                         absl::StrAppend(out, t.name, " (", t.summary, ")");
                       });
}

}  // namespace kvcm
