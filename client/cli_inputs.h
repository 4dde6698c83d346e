// What kvcmctl's shared flags mean: a namespace, a prompt's tokens, a model spec, a tier,
// the transport security and bearer token of its connections.
// Each Define* declares flags on a FlagSet; the matching *From reads them after parsing and
// returns INVALID_ARGUMENT naming the flag when they are missing or wrong.
#ifndef KVCM_CLIENT_CLI_INPUTS_H_
#define KVCM_CLIENT_CLI_INPUTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/cli_args.h"
#include "common/enum_names.h"
#include "common/model_spec.h"
#include "common/security_options.h"
#include "common/types.h"

namespace kvcm::cli {

// --tenant, --model (both required).
void DefineNamespace(FlagSet& f);
absl::StatusOr<NamespaceId> NamespaceFrom(const FlagSet& f);

// --tokens, --tokens_file, --random_tokens (+ --seed, --vocab): exactly one source.
void DefineTokens(FlagSet& f);
absl::StatusOr<std::vector<int32_t>> TokensFrom(const FlagSet& f);

// --preset --attention --num_layers --num_heads --num_kv_heads --head_dim --kv_lora_rank
// --rope_dim --kv_dtype --page_size_tokens (deprecated aliases --layers --heads --kv_heads
// --dtype --page_size). --preset=<catalogue name> starts from that model's spec (in
// --kv_dtype) and the other flags replace only the fields they are given for; an unknown
// preset is INVALID_ARGUMENT listing the known names. Without --num_kv_heads, MHA uses
// --num_heads and MQA 1.
// The spec is not validated here: the manager does it and names the field.
void DefineModelSpec(FlagSet& f);
absl::StatusOr<ModelSpec> ModelSpecFrom(const FlagSet& f);

// --insecure, --tls_ca_file, --tls_cert_file, --tls_key_file (deprecated aliases --ca
// --cert --key); --token, --token_file (global flags).
void DefineSecurity(FlagSet& f);
struct Security {
  TlsOptions tls;     // insecure, or ca_file with cert_file and key_file both or neither
  std::string token;  // empty: none
};
// The connection's security: --insecure, or --tls_ca_file (with --tls_cert_file and
// --tls_key_file for mutual TLS);
// the token from --token_file, --token (not both), or else `env_token` (KVCM_TOKEN; null or
// empty: none). Reads --token_file. INVALID_ARGUMENT naming the flag (or KVCM_TOKEN).
absl::StatusOr<Security> SecurityFrom(const FlagSet& f, const char* env_token);

}  // namespace kvcm::cli

#endif  // KVCM_CLIENT_CLI_INPUTS_H_
