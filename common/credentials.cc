#include "common/credentials.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <grpcpp/support/client_interceptor.h>

#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

using grpc::experimental::FileWatcherCertificateProvider;

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
