// The credentials factory (common/credentials.h) against a small CacheManager stand-in that
// records each call's authorization metadata: which TLS / mTLS combinations connect, which
// are refused, the file checks' errors, and the bearer token on unary and streaming calls.
#include "common/credentials.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "tests/util/test_certs.h"

namespace kvcm {
namespace {

using ::kvcm::testing::TestCerts;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Answers Stats and a one-event WatchEvents, remembering every authorization value sent.
class RecordingService final : public v1::CacheManager::Service {
 public:
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::StatsRequest*,
                     v1::StatsResponse*) override {
    Record(*ctx);
    return grpc::Status::OK;
  }
  grpc::Status WatchEvents(grpc::ServerContext* ctx, const v1::WatchEventsRequest*,
                           grpc::ServerWriter<v1::CacheEvent>* writer) override {
    Record(*ctx);
    writer->Write(v1::CacheEvent());
    return grpc::Status::OK;
  }

  std::vector<std::string> TakeAuthorization() {
    absl::MutexLock lock(&mu_);
    return std::exchange(authorization_, {});
  }

 private:
  void Record(const grpc::ServerContext& ctx) {
    absl::MutexLock lock(&mu_);
    auto [begin, end] = ctx.client_metadata().equal_range(std::string(kAuthorizationKey));
    for (auto it = begin; it != end; ++it) {
      authorization_.emplace_back(it->second.data(), it->second.size());
    }
  }

  absl::Mutex mu_;
  std::vector<std::string> authorization_ ABSL_GUARDED_BY(mu_);
};

class CredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestCerts>> certs = TestCerts::Make();
    ASSERT_TRUE(certs.ok()) << certs.status();
    certs_ = *std::move(certs);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  }

  // Serves the recording service on 127.0.0.1 with `tls`.
  void Serve(const TlsOptions& tls) {
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = MakeServerCredentials(tls);
    ASSERT_TRUE(creds.ok()) << creds.status();
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", *creds, &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port_, 0);
  }

  // Stats through a channel of `factory` to `host`; the call's code.
  grpc::StatusCode Call(const ChannelFactory& factory, const std::string& host = "127.0.0.1") {
    auto stub = v1::CacheManager::NewStub(factory.Open(absl::StrCat(host, ":", port_)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::StatsResponse resp;
    return stub->Stats(&ctx, v1::StatsRequest(), &resp).error_code();
  }
  grpc::StatusCode Call(const TlsOptions& tls, const std::string& host = "127.0.0.1") {
    absl::StatusOr<ChannelFactory> factory = ChannelFactory::Create(tls);
    EXPECT_TRUE(factory.ok()) << factory.status();
    return factory.ok() ? Call(*factory, host) : grpc::StatusCode::INTERNAL;
  }

  std::unique_ptr<TestCerts> certs_;
  RecordingService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST(TlsOptionsTest, AServerNeedsItsCertificateAndKeyUnlessInsecure) {
  auto server = [](TlsOptions tls) { return tls.ValidateForServer(); };
  EXPECT_THAT(server({}).message(), HasSubstr("cert_file"));
  EXPECT_THAT(server({.cert_file = "c.pem"}).message(), HasSubstr("key_file"));
  EXPECT_TRUE(server({.cert_file = "c.pem", .key_file = "k.pem"}).ok());
  EXPECT_TRUE(server({.insecure = true}).ok());
  const absl::Status mixed = server({.insecure = true, .ca_file = "ca.pem"});
  EXPECT_EQ(mixed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mixed.message(), HasSubstr("insecure excludes ca_file"));
  EXPECT_THAT(server({.cert_file = "c", .key_file = "k", .reload_interval_s = 0}).message(),
              HasSubstr("reload_interval_s"));
}

TEST(TlsOptionsTest, AChannelNeedsACaAndBothHalvesOfItsCertificate) {
  auto channel = [](TlsOptions tls) { return tls.ValidateForChannel(); };
  EXPECT_THAT(channel({}).message(), HasSubstr("ca_file"));
  EXPECT_TRUE(channel({.ca_file = "ca.pem"}).ok());
  EXPECT_THAT(channel({.cert_file = "c.pem", .ca_file = "ca.pem"}).message(),
              HasSubstr("key_file"));
  EXPECT_TRUE(channel({.cert_file = "c", .key_file = "k", .ca_file = "ca"}).ok());
  EXPECT_FALSE(channel({.insecure = true, .cert_file = "c"}).ok());
  // Create refuses the same, before opening anything.
  EXPECT_EQ(ChannelFactory::Create(TlsOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CredentialsTest, FileErrorsNameTheFieldAndThePath) {
  TlsOptions tls = certs_->Identity("manager");
  tls.cert_file = certs_->Path("missing.pem");
  absl::Status s = tls.CheckFiles();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("cert_file"));
  EXPECT_THAT(s.message(), HasSubstr("missing.pem"));
  EXPECT_THAT(s.message(), HasSubstr("No such file"));
  EXPECT_EQ(MakeServerCredentials(tls).status(), s);  // at start, not at the first handshake

  tls = certs_->Identity("manager");
  tls.key_file = certs_->Path("client.key");  // another certificate's key
  EXPECT_THAT(tls.CheckFiles().message(), HasSubstr("is not the key of cert_file"));

  tls = certs_->Identity("manager");
  tls.ca_file = certs_->Path("manager.key");  // no certificate in it
  EXPECT_THAT(tls.CheckFiles().message(), HasSubstr("ca_file"));
  EXPECT_THAT(tls.CheckFiles().message(), HasSubstr("holds no PEM certificate"));

  tls = certs_->Identity("manager");
  tls.key_file = certs_->Path("ca.pem");
  EXPECT_THAT(tls.CheckFiles().message(), HasSubstr("holds no unencrypted PEM private key"));

  EXPECT_TRUE(certs_->Identity("manager").CheckFiles().ok());
  EXPECT_THAT(ChannelFactory::Create(certs_->TrustOnly("nope")).status().message(),
              HasSubstr("nope.pem"));
}

TEST_F(CredentialsTest, TlsServesAChannelThatTrustsItsCaAndNoOther) {
  TlsOptions server = certs_->Identity("manager");
  server.ca_file.clear();  // TLS without client certificates
  Serve(server);
  EXPECT_EQ(Call(certs_->TrustOnly()), grpc::StatusCode::OK);
  EXPECT_EQ(Call(certs_->TrustOnly(), "localhost"), grpc::StatusCode::OK);
  EXPECT_EQ(Call(certs_->Identity("client")), grpc::StatusCode::OK);  // an unasked cert is fine
  EXPECT_EQ(Call(ChannelFactory::Insecure()), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(certs_->TrustOnly("untrusted-ca")), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(CredentialsTest, MutualTlsRequiresAClientCertificateFromItsCa) {
  Serve(certs_->Identity("manager"));
  EXPECT_EQ(Call(certs_->Identity("client")), grpc::StatusCode::OK);
  EXPECT_EQ(Call(certs_->Identity("agent-0")), grpc::StatusCode::OK);
  EXPECT_EQ(Call(certs_->TrustOnly()), grpc::StatusCode::UNAVAILABLE);  // no certificate
  // A certificate of the untrusted CA, while trusting the server's.
  TlsOptions stranger = certs_->Identity("untrusted");
  stranger.ca_file = certs_->Path("ca.pem");
  EXPECT_EQ(Call(stranger), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(ChannelFactory::Insecure()), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(CredentialsTest, AServerCertificateReplacedOnDiskServesNewConnections) {
  Serve(certs_->Identity("manager"));
  ASSERT_EQ(Call(certs_->Identity("client")), grpc::StatusCode::OK);
  TlsOptions trusts_untrusted = certs_->Identity("client");
  trusts_untrusted.ca_file = certs_->Path("untrusted-ca.pem");
  ASSERT_EQ(Call(trusts_untrusted), grpc::StatusCode::UNAVAILABLE);

  // The server now presents a certificate of the untrusted CA (reloaded every second).
  ASSERT_TRUE(certs_->Replace("manager", "untrusted").ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (Call(trusts_untrusted) != grpc::StatusCode::OK &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_EQ(Call(trusts_untrusted), grpc::StatusCode::OK);
  EXPECT_EQ(Call(certs_->Identity("client")), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(CredentialsTest, TheBearerTokenGoesWithEveryCallUnaryAndStreaming) {
  Serve(certs_->Identity("manager"));
  absl::StatusOr<ChannelFactory> factory =
      ChannelFactory::Create(certs_->Identity("client"), "s3cret-token");
  ASSERT_TRUE(factory.ok()) << factory.status();
  EXPECT_TRUE(factory->has_token());
  auto stub = v1::CacheManager::NewStub(factory->Open(absl::StrCat("127.0.0.1:", port_)));

  grpc::ClientContext unary;
  v1::StatsResponse stats;
  ASSERT_TRUE(stub->Stats(&unary, v1::StatsRequest(), &stats).ok());
  EXPECT_THAT(service_.TakeAuthorization(), ElementsAre("Bearer s3cret-token"));

  grpc::ClientContext stream_ctx;
  // A value set by hand is replaced, not sent beside the token.
  stream_ctx.AddMetadata("authorization", "Bearer forged");
  std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> reader =
      stub->WatchEvents(&stream_ctx, v1::WatchEventsRequest());
  v1::CacheEvent event;
  while (reader->Read(&event)) {
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_THAT(service_.TakeAuthorization(), ElementsAre("Bearer s3cret-token"));

  // Without a token nothing is sent.
  ASSERT_EQ(Call(certs_->Identity("client")), grpc::StatusCode::OK);
  EXPECT_THAT(service_.TakeAuthorization(), IsEmpty());
}

TEST_F(CredentialsTest, TheTokenIsSentOnAnInsecureChannelToo) {
  Serve(TlsOptions{.insecure = true});
  absl::StatusOr<ChannelFactory> factory = ChannelFactory::Create({.insecure = true}, "dev-token");
  ASSERT_TRUE(factory.ok()) << factory.status();
  ASSERT_EQ(Call(*factory), grpc::StatusCode::OK);
  EXPECT_THAT(service_.TakeAuthorization(), ElementsAre("Bearer dev-token"));
}

TEST_F(CredentialsTest, TokensAreCheckedAndReadFromFiles) {
  EXPECT_FALSE(ValidateBearerToken("").ok());
  EXPECT_FALSE(ValidateBearerToken("two words").ok());
  EXPECT_FALSE(ValidateBearerToken("line\nbreak").ok());
  EXPECT_FALSE(ValidateBearerToken(std::string(4097, 'a')).ok());
  EXPECT_TRUE(ValidateBearerToken("abc-123_XYZ.=+/").ok());
  EXPECT_EQ(ChannelFactory::Create({.insecure = true}, "bad token").status().code(),
            absl::StatusCode::kInvalidArgument);

  const std::string path = certs_->Path("token");
  std::ofstream(path) << "  tok-42\n";
  absl::StatusOr<std::string> token = ReadBearerTokenFile(path, "token_file");
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(*token, "tok-42");
  std::ofstream(path) << "\n";
  EXPECT_THAT(ReadBearerTokenFile(path, "token_file").status().message(), HasSubstr("token_file"));
  absl::Status missing = ReadBearerTokenFile(certs_->Path("none"), "token_file").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.message(), HasSubstr("none"));
}

}  // namespace
}  // namespace kvcm
