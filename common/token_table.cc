#include "common/token_table.h"

#include <openssl/evp.h>
#include <openssl/opensslv.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/security_options.h"

namespace kvcm {
namespace {

constexpr size_t kDigestBytes = 32;
// Shorter tokens are refused by the manager and agents whatever the file says: 16 visible
// ASCII characters is the least a guessing attacker must face. The rest of the rule (length
// cap, characters) is ValidateBearerToken's, shared with the clients.
constexpr size_t kMinTokenBytes = 16;
constexpr size_t kMaxNameBytes = 128;

struct RoleName {
  Role role;
  absl::string_view name;
};
constexpr RoleName kRoleNames[] = {
    {Role::kWorker, "worker"}, {Role::kRouter, "router"}, {Role::kAgent, "agent"},
    {Role::kAdmin, "admin"},   {Role::kEngine, "engine"},
};

// Tenants and agent ids as requests may carry them (common.proto): 1..128 bytes of
// [A-Za-z0-9._:-]. A tenant never has ':', but the file may be stricter than requests.
bool IsValidId(absl::string_view id) {
  if (id.empty() || id.size() > kMaxNameBytes) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-' || c == ':';
  });
}

// SHA-256, fetched from the default provider once. With EVP_sha256() OpenSSL 3 looks the
// algorithm up again on every EVP_Digest: as much as the hashing of a token in a loop, more
// between RPCs (the manager hashes one per call). Never freed.
const EVP_MD* Sha256() {
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
  static const EVP_MD* const kSha256 = [] {
    const EVP_MD* md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
    return md != nullptr ? md : EVP_sha256();
  }();
  return kSha256;
#else
  return EVP_sha256();
#endif
}

std::string RawDigest(absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  // EVP_Digest with SHA-256 cannot fail for in-memory input short of allocation failure.
  EVP_Digest(data.data(), data.size(), digest, &n, Sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(digest), n);
}

}  // namespace

bool Principal::IsWorkerOf(absl::string_view t) const {
  return Has(Role::kWorker) && (worker_of_any_tenant || tenant == t);
}

bool Principal::MayProbe(absl::string_view t) const {
  if (IsWorkerOf(t)) return true;
  if (!Has(Role::kRouter)) return false;
  return probes_any_tenant ||
         std::find(router_tenants.begin(), router_tenants.end(), t) != router_tenants.end();
}

bool Principal::IsAgent(absl::string_view id) const {
  return Has(Role::kAgent) &&
         (any_agent || agent_id == id || (agent_gpu_ids && IsGpuAgentIdOf(id, agent_id)));
}

std::string AllocatorName(const Principal& p) {
  return p.worker_of_any_tenant ? std::string() : p.name;
}

bool IsGpuAgentIdOf(absl::string_view id, absl::string_view name) {
  if (name.empty() || !absl::ConsumePrefix(&id, name) || !absl::ConsumePrefix(&id, "-gpu")) {
    return false;
  }
  if (id.empty() || id.size() > 3 || (id.size() > 1 && id[0] == '0')) return false;
  int k = 0;
  for (char c : id) {
    if (c < '0' || c > '9') return false;
    k = k * 10 + (c - '0');
  }
  return k <= 255;
}

std::optional<std::string> AgentNameFromDnsSan(absl::string_view san, absl::string_view suffix) {
  if (suffix.empty() || !absl::ConsumeSuffix(&san, suffix)) return std::nullopt;
  if (san.empty() || san.size() > 63 || san.front() == '-' || san.back() == '-') {
    return std::nullopt;
  }
  for (char c : san) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return std::nullopt;
  }
  return std::string(san);
}

bool Principal::IsEngineOf(absl::string_view id, absl::string_view t) const {
  return Has(Role::kEngine) && (any_engine || engine_id == id) &&
         (worker_of_any_tenant || tenant == t);
}

std::shared_ptr<const Principal> OpenPrincipal() {
  static const std::shared_ptr<const Principal>* const kOpen = [] {
    auto p = std::make_shared<Principal>();
    p->name = "anonymous (no tokens file)";
    for (const RoleName& r : kRoleNames) p->roles |= static_cast<uint8_t>(r.role);
    p->worker_of_any_tenant = true;
    p->probes_any_tenant = true;
    p->any_agent = true;
    p->any_engine = true;
    return new std::shared_ptr<const Principal>(std::move(p));
  }();
  return *kOpen;
}

std::string RoleNames(uint8_t roles) {
  std::vector<absl::string_view> names;
  for (const RoleName& r : kRoleNames) {
    if ((roles & static_cast<uint8_t>(r.role)) != 0) names.push_back(r.name);
  }
  return names.empty() ? "none" : absl::StrJoin(names, ",");
}

std::string Sha256Hex(absl::string_view data) { return absl::BytesToHexString(RawDigest(data)); }

absl::StatusOr<absl::string_view> BearerToken(absl::string_view authorization) {
  constexpr absl::string_view kScheme = "bearer ";
  if (authorization.size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError(
        "authorization metadata is not \"Bearer <token>\" (kvcm takes bearer tokens)");
  }
  absl::string_view token = absl::StripAsciiWhitespace(authorization.substr(kScheme.size()));
  if (token.size() < kMinTokenBytes) {
    return absl::UnauthenticatedError(
        absl::StrCat("bearer token must be at least ", kMinTokenBytes, " characters"));
  }
  if (absl::Status s = ValidateBearerToken(token); !s.ok()) {
    return absl::UnauthenticatedError(s.message());
  }
  return token;
}

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text, absl::string_view source) {
  TokenTable table;
  absl::flat_hash_set<std::string> names;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_no, ": ", what));
    };
    if (const size_t hash = line.find('#'); hash != absl::string_view::npos) {
      line = line.substr(0, hash);
    }
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() < 3) return bad("expected `<sha256 hex> <name> roles=... [key=value ...]`");

    std::string digest;
    if (fields[0].size() != 2 * kDigestBytes ||
        !std::all_of(fields[0].begin(), fields[0].end(), absl::ascii_isxdigit)) {
      return bad("the first field must be the token's SHA-256, 64 hex digits");
    }
    digest = absl::HexStringToBytes(absl::AsciiStrToLower(fields[0]));
    if (table.by_hash_.contains(digest)) return bad("this token hash appears twice");

    auto p = std::make_shared<Principal>();
    p->name = std::string(fields[1]);
    if (!IsValidId(p->name)) return bad(absl::StrCat("bad principal name \"", p->name, "\""));
    if (!names.insert(p->name).second) {
      return bad(absl::StrCat("principal name \"", p->name, "\" appears twice"));
    }
    bool has_roles = false;
    for (size_t i = 2; i < fields.size(); ++i) {
      std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(fields[i], '=');
      const absl::string_view key = kv.first, value = kv.second;
      if (value.empty()) return bad(absl::StrCat("\"", fields[i], "\" is not key=value"));
      if (key == "roles") {
        has_roles = true;
        for (absl::string_view role : absl::StrSplit(value, ',')) {
          auto it = std::find_if(std::begin(kRoleNames), std::end(kRoleNames),
                                 [&](const RoleName& r) { return r.name == role; });
          if (it == std::end(kRoleNames)) {
            return bad(
                absl::StrCat("unknown role \"", role, "\" (worker, router, agent, engine, admin)"));
          }
          p->roles |= static_cast<uint8_t>(it->role);
        }
      } else if (key == "tenant") {
        if (!IsValidId(value)) return bad(absl::StrCat("bad tenant \"", value, "\""));
        p->tenant = std::string(value);
      } else if (key == "tenants") {
        for (absl::string_view t : absl::StrSplit(value, ',')) {
          if (t == "*") {
            p->probes_any_tenant = true;
          } else if (!IsValidId(t)) {
            return bad(absl::StrCat("bad tenant \"", t, "\" in tenants="));
          } else {
            p->router_tenants.emplace_back(t);
          }
        }
      } else if (key == "agent") {
        if (!IsValidId(value)) return bad(absl::StrCat("bad agent id \"", value, "\""));
        p->agent_id = std::string(value);
      } else if (key == "engine") {
        if (!IsValidId(value)) return bad(absl::StrCat("bad engine id \"", value, "\""));
        p->engine_id = std::string(value);
      } else {
        return bad(
            absl::StrCat("unknown key \"", key, "\" (roles, tenant, tenants, agent, engine)"));
      }
    }
    if (!has_roles || p->roles == 0) return bad("roles= is required");
    if (p->Has(Role::kWorker) && p->tenant.empty()) return bad("role worker needs tenant=");
    if (p->Has(Role::kRouter) && p->router_tenants.empty() && !p->probes_any_tenant) {
      return bad("role router needs tenants= (a list, or *)");
    }
    if (p->Has(Role::kAgent) && p->agent_id.empty()) return bad("role agent needs agent=");
    if (p->Has(Role::kEngine) && (p->engine_id.empty() || p->tenant.empty())) {
      return bad("role engine needs engine= and tenant=");
    }
    // A worker's tenant is always exact; tenants= (even *) grants probing only.
    if ((!p->router_tenants.empty() || p->probes_any_tenant) && !p->Has(Role::kRouter)) {
      return bad("tenants= is for role router");
    }
    if (!p->tenant.empty()) table.tenants_.insert(p->tenant);
    table.by_hash_.emplace(std::move(digest), std::move(p));
  }
  if (table.by_hash_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source,
                                                   ": no principal (an empty tokens file "
                                                   "would lock every caller out)"));
  }
  return table;
}

absl::StatusOr<TokenTable> TokenTable::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read tokens file ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return Parse(text.str(), path);
}

std::shared_ptr<const Principal> TokenTable::Find(absl::string_view token) const {
  auto it = by_hash_.find(RawDigest(token));
  return it == by_hash_.end() ? nullptr : it->second;
}

}  // namespace kvcm
