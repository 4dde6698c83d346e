#include "common/agent_identity.h"

#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <limits>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/token_table.h"

namespace kvcm {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct GeneralNamesFree {
  void operator()(GENERAL_NAMES* n) const { GENERAL_NAMES_free(n); }
};

}  // namespace

absl::StatusOr<std::vector<std::string>> DnsSubjectAltNames(absl::string_view pem) {
  if (pem.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return absl::InvalidArgumentError("certificate PEM is too large");
  }
  std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (bio == nullptr) return absl::InternalError("BIO_new_mem_buf failed");
  std::unique_ptr<X509, X509Free> cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) return absl::InvalidArgumentError("no PEM certificate");
  int critical = 0;
  std::unique_ptr<GENERAL_NAMES, GeneralNamesFree> names(static_cast<GENERAL_NAMES*>(
      X509_get_ext_d2i(cert.get(), NID_subject_alt_name, &critical, nullptr)));
  std::vector<std::string> dns;
  if (names == nullptr) {
    // -1: no subjectAltName extension (a common-name-only certificate); else it is broken.
    if (critical == -1) return dns;
    return absl::InvalidArgumentError("the certificate's subjectAltName extension does not parse");
  }
  for (int i = 0; i < sk_GENERAL_NAME_num(names.get()); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names.get(), i);
    if (name->type != GEN_DNS) continue;
    const ASN1_STRING* value = name->d.dNSName;
    const int length = ASN1_STRING_length(value);
    if (length < 0) continue;
    std::string s(reinterpret_cast<const char*>(ASN1_STRING_get0_data(value)),
                  static_cast<size_t>(length));
    if (s.find('\0') != std::string::npos) continue;
    dns.push_back(std::move(s));
  }
  return dns;
}

absl::StatusOr<std::optional<std::string>> AgentNameOfCertificate(absl::string_view pem,
                                                                  absl::string_view suffix) {
  if (suffix.empty()) return std::nullopt;
  absl::StatusOr<std::vector<std::string>> dns = DnsSubjectAltNames(pem);
  if (!dns.ok()) return dns.status();
  std::vector<std::string> agents;
  for (const std::string& san : *dns) {
    std::optional<std::string> name = AgentNameFromDnsSan(san, suffix);
    if (!name.has_value()) continue;
    bool seen = false;
    for (const std::string& a : agents) seen = seen || a == *name;
    if (!seen) agents.push_back(*std::move(name));
  }
  if (agents.empty()) return std::nullopt;
  if (agents.size() > 1) {
    return absl::UnauthenticatedError(
        absl::StrCat("the certificate names ", agents.size(), " agents under ", suffix, " (",
                     absl::StrJoin(agents, ", "),
                     "); an agent's certificate must name exactly one, so it names none"));
  }
  return std::move(agents.front());
}

}  // namespace kvcm
