#include "common/credentials.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <grpcpp/support/client_interceptor.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

using grpc::experimental::FileWatcherCertificateProvider;

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", what));
}

absl::Status FileError(absl::string_view field, const std::string& path, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, " \"", path, "\": ", why));
}

// The oldest error of this thread's OpenSSL queue, and the queue emptied.
std::string TakeOpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "no details";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
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

// Removes "authorization" entries a caller set by hand, then adds the token: one value only.
class BearerTokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerTokenInterceptor(std::string value) : value_(std::move(value)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      std::multimap<std::string, std::string>* metadata = methods->GetSendInitialMetadata();
      metadata->erase(std::string(kAuthorizationKey));
      metadata->emplace(std::string(kAuthorizationKey), value_);
    }
    methods->Proceed();
  }

 private:
  const std::string value_;
};

class BearerTokenInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerTokenInterceptorFactory(std::string value) : value_(std::move(value)) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerTokenInterceptor(value_);
  }

 private:
  const std::string value_;
};

}  // namespace

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

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& tls) {
  if (absl::Status s = tls.ValidateForServer(); !s.ok()) return s;
  if (tls.insecure) return MakeInsecureServerCredentials();
  if (absl::Status s = tls.CheckFiles(); !s.ok()) return s;
  auto provider = std::make_shared<FileWatcherCertificateProvider>(
      tls.key_file, tls.cert_file, tls.ca_file, tls.reload_interval_s);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (tls.ca_file.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ServerCredentials> MakeInsecureServerCredentials() {
  return grpc::InsecureServerCredentials();
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

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, absl::string_view field) {
  absl::StatusOr<std::string> text = ReadWholeFile(path, field);
  if (!text.ok()) return text.status();
  std::string token(absl::StripAsciiWhitespace(*text));
  if (absl::Status s = ValidateBearerToken(token); !s.ok()) {
    return FileError(field, path, s.message());
  }
  return token;
}

ChannelFactory::ChannelFactory(std::shared_ptr<grpc::ChannelCredentials> credentials, bool insecure,
                               std::string bearer_token)
    : credentials_(std::move(credentials)),
      insecure_(insecure),
      bearer_token_(std::move(bearer_token)) {}

absl::StatusOr<ChannelFactory> ChannelFactory::Create(const TlsOptions& tls,
                                                      std::string bearer_token) {
  if (absl::Status s = tls.ValidateForChannel(); !s.ok()) return s;
  if (!bearer_token.empty()) {
    if (absl::Status s = ValidateBearerToken(bearer_token); !s.ok()) return s;
  }
  if (tls.insecure) {
    return ChannelFactory(grpc::InsecureChannelCredentials(), true, std::move(bearer_token));
  }
  if (absl::Status s = tls.CheckFiles(); !s.ok()) return s;
  std::shared_ptr<FileWatcherCertificateProvider> provider =
      tls.cert_file.empty()
          ? std::make_shared<FileWatcherCertificateProvider>(tls.ca_file, tls.reload_interval_s)
          : std::make_shared<FileWatcherCertificateProvider>(tls.key_file, tls.cert_file,
                                                             tls.ca_file, tls.reload_interval_s);
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  options.watch_root_certs();
  if (!tls.cert_file.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  return ChannelFactory(grpc::experimental::TlsCredentials(options), false,
                        std::move(bearer_token));
}

ChannelFactory ChannelFactory::Insecure() {
  return ChannelFactory(grpc::InsecureChannelCredentials(), true, "");
}

std::shared_ptr<grpc::Channel> ChannelFactory::Open(const std::string& address,
                                                    const grpc::ChannelArguments& args) const {
  if (bearer_token_.empty()) return grpc::CreateCustomChannel(address, credentials_, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(
      std::make_unique<BearerTokenInterceptorFactory>(absl::StrCat(kBearerPrefix, bearer_token_)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials_, args,
                                                                 std::move(interceptors));
}

std::shared_ptr<grpc::Channel> MakeInsecureChannel(const std::string& address,
                                                   const grpc::ChannelArguments& args) {
  return ChannelFactory::Insecure().Open(address, args);
}

}  // namespace kvcm
