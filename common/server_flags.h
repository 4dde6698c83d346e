// The flags every kvcm gRPC server shares, defined once (server_flags.cc) for kvcm-manager and
// kvcm-agent: its connection limits, --grpc_<name> for each ServerLimitsOptions::<name>, and
// its transport security, --tls_cert_file, --tls_key_file, --tls_ca_file,
// --tls_reload_interval_s and --insecure for the TlsOptions fields. Their defaults are those
// structs' defaults; their ranges are checked where the options are validated, not here.
//
// Link kvcm_server_flags: an object library, so that the flags are registered in a main that
// only looks them up by name, as kvcm-manager does (its config file sits between its defaults
// and its flags, so it applies only the flags given; see ServerOptions::Set).
#ifndef KVCM_COMMON_SERVER_FLAGS_H_
#define KVCM_COMMON_SERVER_FLAGS_H_

#include "common/security_options.h"
#include "common/server_limits.h"

namespace kvcm {

// Sets every field of `limits` and `tls` from its flag. Call after ParseProgramFlags.
void ReadServerFlags(ServerLimitsOptions* limits, TlsOptions* tls);

}  // namespace kvcm

#endif  // KVCM_COMMON_SERVER_FLAGS_H_
