// Streams per principal on the manager (max_streams_per_principal): a principal's long-lived
// streams beyond the cap are RESOURCE_EXHAUSTED naming the option, other principals are not
// affected, and a closed stream frees its slot. Against a real ManagerServer with a tokens
// file, over loopback.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/credentials.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "server/service/manager_server.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr char kOps[] = "ops-token-0123456789abcdef";
constexpr char kOps2[] = "ops2-token-0123456789abcde";

// One WatchEvents call of `token`; open() once the server subscribed it.
class Watch {
 public:
  Watch(v1::CacheManager::Stub* stub, const std::string& token, int deadline_ms = 20'000) {
    ctx_.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
    reader_ = stub->WatchEvents(&ctx_, v1::WatchEventsRequest());
    reader_->WaitForInitialMetadata();
  }
  ~Watch() {
    if (finished_) return;
    ctx_.TryCancel();
    (void)End();
  }
  // How the stream ends: at once with a refusal, or DEADLINE_EXCEEDED when it was open.
  grpc::Status End() {
    v1::CacheEvent e;
    while (reader_->Read(&e)) {
    }
    finished_ = true;
    return reader_->Finish();
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> reader_;
  bool finished_ = false;
};

TEST(StreamLimitsRpcTest, StreamsBeyondThePrincipalCapAreRefusedNamingTheOption) {
  const std::string tokens = absl::StrCat(::testing::TempDir(), "/kvcm_stream_tokens_", getpid());
  std::ofstream(tokens) << Sha256Hex(kOps) << " ops roles=admin\n"
                        << Sha256Hex(kOps2) << " ops2 roles=admin\n";
  ServerOptions o;
  o.tls.insecure = true;
  o.listen_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.tokens_file = tokens;
  o.shutdown_grace_ms = 100;
  o.max_streams_per_principal = 2;
  absl::StatusOr<std::unique_ptr<ManagerServer>> server = ManagerServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  std::unique_ptr<v1::CacheManager::Stub> stub =
      v1::CacheManager::NewStub(MakeInsecureChannel((*server)->address()));

  // An open stream lasts until its deadline; a refused one ends at once.
  auto open = [&](const std::string& token) {
    return Watch(stub.get(), token, 300).End().error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
  };
  auto first = std::make_unique<Watch>(stub.get(), kOps);
  Watch second(stub.get(), kOps);
  {
    Watch third(stub.get(), kOps);
    const grpc::Status s = third.End();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("max_streams_per_principal = 2"));
    EXPECT_THAT(s.error_message(), HasSubstr("WatchEvents"));
  }
  // Another principal has its own slots.
  EXPECT_TRUE(open(kOps2));
  // Closing a stream frees its slot, once the server has seen the cancel.
  first.reset();
  bool reopened = false;
  for (int i = 0; i < 20 && !reopened; ++i) reopened = open(kOps);
  EXPECT_TRUE(reopened);

  // Stats reports the limits in force.
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", absl::StrCat("Bearer ", kOps));
  v1::StatsRequest req;
  v1::StatsResponse stats;
  ASSERT_TRUE(stub->Stats(&ctx, req, &stats).ok());
  EXPECT_EQ(stats.limits().max_streams_per_principal(), 2u);
  EXPECT_EQ(stats.limits().grpc_handshake_timeout_ms(), o.limits.handshake_timeout_ms);
  EXPECT_EQ(stats.limits().grpc_max_concurrent_streams(), o.limits.max_concurrent_streams);
  EXPECT_EQ(stats.limits().grpc_max_connections_per_peer(), o.limits.max_connections_per_peer);
  EXPECT_GT(stats.limits().grpc_max_connections(), 0u);
  EXPECT_LE(stats.limits().grpc_max_connections(), o.limits.max_connections);
  (*server)->Shutdown();
  std::remove(tokens.c_str());
}

}  // namespace
}  // namespace kvcm
