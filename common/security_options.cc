#include "common/security_options.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvcm {

absl::Status ValidateAgentIdentity(absl::string_view suffix, absl::string_view tokens_file,
                                   absl::string_view tls_ca_file) {
  if (suffix.empty()) return absl::OkStatus();
  if (suffix.front() != '.' || suffix.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("agent_identity_dns_suffix must start with '.' and name a domain (e.g. "
                     ".kvcm-agent.kvcm.svc), got \"",
                     suffix, "\""));
  }
  if (tokens_file.empty()) {
    return absl::InvalidArgumentError(
        "agent_identity_dns_suffix needs tokens_file: without one no caller is authenticated");
  }
  if (tls_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "agent_identity_dns_suffix needs tls_ca_file: certificates identify agents only when "
        "client certificates are required and verified");
  }
  return absl::OkStatus();
}
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", what));
}

absl::Status FileError(absl::string_view field, const std::string& path, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, " \"", path, "\": ", why));
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, absl::string_view field) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return FileError(field, path, absl::StrCat("cannot open: ", std::strerror(errno)));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return FileError(field, path, "read error");
  return text.str();
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

// Refuses to prompt on the terminal for an encrypted key's passphrase.
int NoPassphrase(char*, int, int, void*) { return 0; }

// Every certificate of a PEM file, in order; INVALID_ARGUMENT when it holds none.
absl::StatusOr<std::vector<X509Ptr>> ReadCertificates(const std::string& path,
                                                      absl::string_view field) {
  absl::StatusOr<std::string> pem = ReadWholeFile(path, field);
  if (!pem.ok()) return pem.status();
  BioPtr bio(BIO_new_mem_buf(pem->data(), static_cast<int>(pem->size())));
  std::vector<X509Ptr> certs;
  while (X509* cert = PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr)) {
    certs.emplace_back(cert);
  }
  ERR_clear_error();  // the read past the last certificate leaves "no start line"
  if (certs.empty()) return FileError(field, path, "holds no PEM certificate");
  return certs;
}

}  // namespace

std::string TakeOpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "no details";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

absl::Status TlsOptions::ValidateForServer() const {
  if (insecure) {
    if (!cert_file.empty()) return Invalid("insecure", "excludes cert_file");
    if (!key_file.empty()) return Invalid("insecure", "excludes key_file");
    if (!ca_file.empty()) return Invalid("insecure", "excludes ca_file");
    return absl::OkStatus();
  }
  if (cert_file.empty()) return Invalid("cert_file", "is required for TLS");
  if (key_file.empty()) return Invalid("key_file", "is required for TLS");
  if (reload_interval_s < 1 || reload_interval_s > 86'400) {
    return Invalid("reload_interval_s",
                   absl::StrCat("must be in [1, 86400], got ", reload_interval_s));
  }
  return absl::OkStatus();
}

absl::Status TlsOptions::ValidateForChannel() const {
  if (insecure) return ValidateForServer();  // the same exclusions
  if (ca_file.empty()) return Invalid("ca_file", "is required to verify the server");
  if (cert_file.empty() != key_file.empty()) {
    return Invalid(cert_file.empty() ? "cert_file" : "key_file",
                   "is required with the other half of the client certificate");
  }
  if (reload_interval_s < 1 || reload_interval_s > 86'400) {
    return Invalid("reload_interval_s",
                   absl::StrCat("must be in [1, 86400], got ", reload_interval_s));
  }
  return absl::OkStatus();
}

absl::Status TlsOptions::CheckFiles() const {
  if (!ca_file.empty()) {
    if (absl::StatusOr<std::vector<X509Ptr>> ca = ReadCertificates(ca_file, "ca_file"); !ca.ok()) {
      return ca.status();
    }
  }
  if (cert_file.empty() && key_file.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<X509Ptr>> chain = ReadCertificates(cert_file, "cert_file");
  if (!chain.ok()) return chain.status();
  absl::StatusOr<std::string> pem = ReadWholeFile(key_file, "key_file");
  if (!pem.ok()) return pem.status();
  BioPtr bio(BIO_new_mem_buf(pem->data(), static_cast<int>(pem->size())));
  PkeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  if (key == nullptr) {
    return FileError(
        "key_file", key_file,
        absl::StrCat("holds no unencrypted PEM private key (", TakeOpenSslError(), ")"));
  }
  if (X509_check_private_key(chain->front().get(), key.get()) != 1) {
    ERR_clear_error();
    return FileError("key_file", key_file,
                     absl::StrCat("is not the key of cert_file \"", cert_file, "\""));
  }
  return absl::OkStatus();
}

absl::Status ValidateBearerToken(absl::string_view token) {
  if (token.empty() || token.size() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("bearer token must be 1..4096 characters, got ", token.size()));
  }
  for (char c : token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(
          "bearer token must be visible ASCII (no space, control or non-ASCII character)");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadBearerTokenFile(const std::string& path, absl::string_view field) {
  absl::StatusOr<std::string> text = ReadWholeFile(path, field);
  if (!text.ok()) return text.status();
  std::string token(absl::StripAsciiWhitespace(*text));
  if (absl::Status s = ValidateBearerToken(token); !s.ok()) {
    return FileError(field, path, s.message());
  }
  return token;
}

}  // namespace kvcm
