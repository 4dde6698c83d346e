// A hint for the likeliest mistake behind an UNAVAILABLE call: plaintext against a TLS
// server, or TLS against a plaintext one. gRPC reports both as a lost connection or a
// failed handshake, which does not say which side is wrong.
#ifndef KVCM_CLIENT_TLS_HINT_H_
#define KVCM_CLIENT_TLS_HINT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcm {

// One line naming the likely fix when `status` is UNAVAILABLE and its text suggests a
// transport security mismatch for a channel that was plaintext (`insecure`) or TLS; empty
// otherwise. `server` names the peer in the line ("the manager").
std::string TlsMismatchHint(const absl::Status& status, bool insecure, absl::string_view server);

// `status` with TlsMismatchHint appended to its message on a line of its own, or `status`
// unchanged when there is no hint.
absl::Status WithTlsMismatchHint(absl::Status status, bool insecure, absl::string_view server);

}  // namespace kvcm

#endif  // KVCM_CLIENT_TLS_HINT_H_
