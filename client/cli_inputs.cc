#include "client/cli_inputs.h"

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model_catalog.h"

namespace kvcm::cli {
void DefineNamespace(FlagSet& f) {
  f.AddString("tenant", "", "tenant of the namespace (required)");
  f.AddString("model", "", "model of the namespace (required)");
}

absl::StatusOr<NamespaceId> NamespaceFrom(const FlagSet& f) {
  if (f.GetString("tenant").empty()) {
    return absl::InvalidArgumentError("--tenant is required");
  }
  if (f.GetString("model").empty()) {
    return absl::InvalidArgumentError("--model is required");
  }
  return NamespaceId{f.GetString("tenant"), f.GetString("model")};
}

void DefineTokens(FlagSet& f) {
  f.AddString("tokens", "", "prompt token ids, comma or space separated");
  f.AddString("tokens_file", "", "file of token ids, comma or whitespace separated");
  f.AddUint("random_tokens", 0, "use N pseudo-random tokens instead (see --seed, --vocab)");
  f.AddUint("seed", 1, "seed of --random_tokens; equal seeds give equal prompts");
  f.AddUint("vocab", 32000, "--random_tokens draws ids from [0, vocab)");
}

absl::StatusOr<std::vector<int32_t>> TokensFrom(const FlagSet& f) {
  const int sources = f.IsSet("tokens") + f.IsSet("tokens_file") + f.IsSet("random_tokens");
  if (sources != 1) {
    return absl::InvalidArgumentError(
        "give exactly one of --tokens, --tokens_file, --random_tokens");
  }
  if (f.IsSet("tokens")) {
    return ParseTokenList(f.GetString("tokens"));
  }
  if (f.IsSet("tokens_file")) {
    return ReadTokenFile(f.GetString("tokens_file"));
  }
  const uint64_t vocab = f.GetUint("vocab");
  if (vocab == 0 || vocab > (uint64_t{1} << 31)) {
    return absl::InvalidArgumentError("--vocab: must be in 1..2^31");
  }
  return RandomTokens(f.GetUint("random_tokens"), f.GetUint("seed"), static_cast<uint32_t>(vocab));
}

void DefineModelSpec(FlagSet& f) {
  f.AddString("preset", "",
              "start from this catalogue model (see 'kvcmctl models'); the flags below "
              "override its fields");
  f.AddString("attention", "mla", "attention kind: mla|gqa|mha|mqa");
  f.AddUint("num_layers", 0, "transformer layers with a KV cache");
  f.AddUint("num_heads", 0, "query heads");
  f.AddUint("num_kv_heads", 0, "K/V heads (gqa; mha uses --num_heads, mqa 1)");
  f.AddUint("head_dim", 0, "elements per K/V head (mha/mqa/gqa)");
  f.AddUint("kv_lora_rank", 0, "MLA latent width (DeepSeek-V3: 512)");
  f.AddUint("rope_dim", 0, "MLA decoupled RoPE width (DeepSeek-V3: 64)");
  f.AddString("kv_dtype", "bf16", "KV element type: bf16|fp16|fp8|int8");
  f.AddUint("page_size_tokens", kDefaultPageSizeTokens, "tokens per page");
  f.AddString("kv_layout", "",
              "byte layout of a page, as the engine's connector names it (e.g. "
              "vllm/CPU_MLA:bf16:block[1,16,576]:order[1,2]); empty: not stated, compatible "
              "with any");
  f.AddDeprecatedAlias("layers", "num_layers");
  f.AddDeprecatedAlias("heads", "num_heads");
  f.AddDeprecatedAlias("kv_heads", "num_kv_heads");
  f.AddDeprecatedAlias("dtype", "kv_dtype");
  f.AddDeprecatedAlias("page_size", "page_size_tokens");
}

absl::StatusOr<ModelSpec> ModelSpecFrom(const FlagSet& f) {
  absl::StatusOr<KvDtype> dtype = ParseDtype(f.GetString("kv_dtype"), "--kv_dtype");
  if (!dtype.ok()) {
    return dtype.status();
  }
  // With --preset, a flag replaces the catalogue's value only when it is given.
  const bool preset = f.IsSet("preset");
  ModelSpec spec;
  spec.dtype = *dtype;
  if (preset) {
    absl::StatusOr<ModelSpec> found = FindModel(f.GetString("preset"), *dtype);
    if (!found.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--preset: ", found.status().message()));
    }
    spec = *found;
  }
  if (!preset || f.IsSet("attention")) {
    absl::StatusOr<AttentionKind> attention =
        ParseAttention(f.GetString("attention"), "--attention");
    if (!attention.ok()) {
      return attention.status();
    }
    spec.attention = *attention;
  }
  const std::pair<const char*, uint32_t*> fields[] = {{"num_layers", &spec.num_layers},
                                                      {"num_heads", &spec.num_heads},
                                                      {"num_kv_heads", &spec.num_kv_heads},
                                                      {"head_dim", &spec.head_dim},
                                                      {"kv_lora_rank", &spec.kv_lora_rank},
                                                      {"rope_dim", &spec.rope_dim},
                                                      {"page_size_tokens", &spec.page_size_tokens}};
  for (const auto& [name, field] : fields) {
    if (preset && !f.IsSet(name)) {
      continue;
    }
    const uint64_t value = f.GetUint(name);
    if (value > UINT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": too large"));
    }
    *field = static_cast<uint32_t>(value);
  }
  if (!preset || f.IsSet("kv_layout")) {
    spec.kv_layout = f.GetString("kv_layout");
  }
  if (spec.attention == AttentionKind::kMha && !f.IsSet("num_kv_heads")) {
    spec.num_kv_heads = spec.num_heads;
  }
  if (spec.attention == AttentionKind::kMqa && !f.IsSet("num_kv_heads")) {
    spec.num_kv_heads = 1;
  }
  return spec;
}

void DefineSecurity(FlagSet& f) {
  f.AddBool("insecure", "plaintext, for a manager started with --insecure (development only)");
  f.AddString("tls_ca_file", "", "PEM CA bundle that verifies the manager (and agents): TLS");
  f.AddString("tls_cert_file", "",
              "PEM client certificate, for a manager or agent that requires one");
  f.AddString("tls_key_file", "", "PEM private key of --tls_cert_file");
  f.AddString("token", "",
              "bearer token sent with every call; visible to every user in ps: prefer "
              "--token_file or KVCM_TOKEN");
  f.AddString("token_file", "", "file holding the bearer token (default: $KVCM_TOKEN)");
  f.AddDeprecatedAlias("ca", "tls_ca_file");
  f.AddDeprecatedAlias("cert", "tls_cert_file");
  f.AddDeprecatedAlias("key", "tls_key_file");
}

absl::StatusOr<Security> SecurityFrom(const FlagSet& f, const char* env_token) {
  Security out;
  out.tls = TlsOptions{.insecure = f.GetBool("insecure"),
                       .cert_file = f.GetString("tls_cert_file"),
                       .key_file = f.GetString("tls_key_file"),
                       .ca_file = f.GetString("tls_ca_file")};
  if (out.tls.insecure) {
    if (!out.tls.ca_file.empty() || !out.tls.cert_file.empty() || !out.tls.key_file.empty()) {
      return absl::InvalidArgumentError(
          "--insecure excludes --tls_ca_file, --tls_cert_file and --tls_key_file");
    }
  } else if (out.tls.ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_ca_file is required to verify the manager (or --insecure for a plaintext "
        "manager)");
  } else if (out.tls.cert_file.empty() != out.tls.key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert_file and --tls_key_file go together");
  }

  if (f.IsSet("token") && f.IsSet("token_file")) {
    return absl::InvalidArgumentError("give one of --token and --token_file");
  }
  if (f.IsSet("token_file")) {
    absl::StatusOr<std::string> token =
        ReadBearerTokenFile(f.GetString("token_file"), "--token_file");
    if (!token.ok()) return token.status();
    out.token = *std::move(token);
  } else if (f.IsSet("token")) {
    out.token = f.GetString("token");
    if (absl::Status s = ValidateBearerToken(out.token); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--token: ", s.message()));
    }
  } else if (env_token != nullptr && env_token[0] != '\0') {
    out.token = env_token;
    if (absl::Status s = ValidateBearerToken(out.token); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("KVCM_TOKEN: ", s.message()));
    }
  }
  return out;
}

}  // namespace kvcm::cli
