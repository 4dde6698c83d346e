// The client's bearer token on the wire: stand-ins for the manager's CacheManager and an
// agent's BlockAgent record the authorization metadata of every call they get from
// kvcm::Client (unary and WatchEvents) and from AgentBlocks on Client::channels().
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/agent_blocks.h"
#include "client/client.h"
#include "common/credentials.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"

namespace kvcm {
namespace {

using ::testing::ElementsAre;

// "<rpc> <authorization value or -"> per call, in arrival order.
class CallLog {
 public:
  void Record(absl::string_view rpc, const grpc::ServerContext& ctx) {
    std::string auth = "-";
    auto it = ctx.client_metadata().find(std::string(kAuthorizationKey));
    if (it != ctx.client_metadata().end()) auth.assign(it->second.data(), it->second.size());
    absl::MutexLock lock(&mu_);
    calls_.push_back(absl::StrCat(rpc, " ", auth));
  }
  std::vector<std::string> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(calls_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
};

class FakeManager final : public v1::CacheManager::Service {
 public:
  explicit FakeManager(CallLog* log) : log_(log) {}
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::StatsRequest*,
                     v1::StatsResponse*) override {
    log_->Record("Stats", *ctx);
    return grpc::Status::OK;
  }
  grpc::Status WatchEvents(grpc::ServerContext* ctx, const v1::WatchEventsRequest*,
                           grpc::ServerWriter<v1::CacheEvent>*) override {
    log_->Record("WatchEvents", *ctx);
    return grpc::Status::OK;  // ends the stream at once
  }

 private:
  CallLog* log_;
};

class FakeAgent final : public v1::BlockAgent::Service {
 public:
  explicit FakeAgent(CallLog* log) : log_(log) {}
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::BlockAgentStatsRequest*,
                     v1::BlockAgentStatsResponse* resp) override {
    log_->Record("Agent.Stats", *ctx);
    resp->set_epoch(7);
    return grpc::Status::OK;
  }
  grpc::Status Allocate(grpc::ServerContext* ctx, const v1::AllocateBlocksRequest* req,
                        v1::AllocateBlocksResponse* resp) override {
    log_->Record("Agent.Allocate", *ctx);
    for (uint32_t i = 0; i < req->count(); ++i) resp->add_block_ids(i);
    return grpc::Status::OK;
  }
  grpc::Status Free(grpc::ServerContext* ctx, const v1::FreeBlocksRequest*,
                    v1::FreeBlocksResponse*) override {
    log_->Record("Agent.Free", *ctx);
    return grpc::Status::OK;
  }

 private:
  CallLog* log_;
};

class ClientTokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", MakeInsecureServerCredentials(), &port_);
    builder.RegisterService(&manager_);
    builder.RegisterService(&agent_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now()); }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  // Stats, a WatchEvents stream to its end, and an agent allocation freed again.
  void CallEverything(Client& client) {
    ASSERT_TRUE(client.Stats().ok());
    std::unique_ptr<EventWatch> watch = client.WatchEvents(std::nullopt, [](const auto&) {});
    EXPECT_TRUE(watch->Wait().ok());
    absl::StatusOr<AgentBlocks> blocks =
        AgentBlocks::Allocate(client.channels(), address(), {"acme", "m"}, 2);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    EXPECT_EQ(blocks->epoch(), 7u);
    ASSERT_TRUE(blocks->Free(blocks->ids()).ok());
  }

  CallLog log_;
  FakeManager manager_{&log_};
  FakeAgent agent_{&log_};
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(ClientTokenTest, EveryCallCarriesTheToken) {
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.address = address(), .insecure = true, .token = "tok-1"});
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_NO_FATAL_FAILURE(CallEverything(**client));
  EXPECT_THAT(log_.Take(), ElementsAre("Stats Bearer tok-1", "WatchEvents Bearer tok-1",
                                       "Agent.Stats Bearer tok-1", "Agent.Allocate Bearer tok-1",
                                       "Agent.Free Bearer tok-1"));
}

TEST_F(ClientTokenTest, NoTokenSendsNoAuthorization) {
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect({.address = address(), .insecure = true});
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_NO_FATAL_FAILURE(CallEverything(**client));
  EXPECT_THAT(log_.Take(), ElementsAre("Stats -", "WatchEvents -", "Agent.Stats -",
                                       "Agent.Allocate -", "Agent.Free -"));
}

}  // namespace
}  // namespace kvcm
