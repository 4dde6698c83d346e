// Agent identity from a certificate (docs/SECURITY.md, "Agent identity"): which agent a
// verified peer certificate names under the operator's DNS suffix. Only DNS subjectAltNames
// count; the subject's common name and URI, email, IP and other subjectAltNames are never
// read, however they are spelled. The certificate is parsed here (OpenSSL), not taken from
// gRPC's `x509_subject_alternative_name` property, which mixes every kind of name. No gRPC.
//
// Thread-safe (pure functions).
#ifndef KVCM_COMMON_AGENT_IDENTITY_H_
#define KVCM_COMMON_AGENT_IDENTITY_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcm {

// The DNS subjectAltNames (GEN_DNS) of the first certificate in `pem`, in certificate order;
// a name holding a NUL byte is left out. INVALID_ARGUMENT when `pem` holds no certificate or
// its subjectAltName extension does not parse.
absl::StatusOr<std::vector<std::string>> DnsSubjectAltNames(absl::string_view pem);

// The agent name N the certificate `pem` proves under `suffix` (".kvcm-agent.kvcm.svc"):
// the DNS subjectAltNames that AgentNameFromDnsSan (token_table.h) accepts must all name the
// same N (the same name twice is one). nullopt when none does, or `suffix` is empty.
// UNAUTHENTICATED naming them when they name two or more agents: such a certificate proves
// no agent (one pod, one name; a certificate for several is a mis-issue). INVALID_ARGUMENT
// as DnsSubjectAltNames.
absl::StatusOr<std::optional<std::string>> AgentNameOfCertificate(absl::string_view pem,
                                                                  absl::string_view suffix);

}  // namespace kvcm

#endif  // KVCM_COMMON_AGENT_IDENTITY_H_
