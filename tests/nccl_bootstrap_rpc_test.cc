// AgentControl.NcclBootstrap against a real manager on a loopback port, spoken by fake agents
// over the real protocol (Register, Heartbeat, a Commands stream): the peer receives the
// ncclUniqueId and both ranks as an unnumbered NcclConnect on its stream, and every refusal
// answers its documented code, names the field and queues nothing. No NCCL here: the id is
// opaque bytes to the manager, so this runs on any CPU.

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/credentials.h"
#include "common/model_catalog.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "proto/core_types.h"
#include "server/service/manager_server.h"
#include "tests/util/agent_rpc.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using testing::WaitFor;

// An agent spoken by hand: registers, heartbeats on demand, and records every command its
// Commands stream receives (acking nothing: the offers need no ack, and the test sends no
// numbered command).
class FakeAgent {
 public:
  FakeAgent(const std::string& manager, std::string id, uint64_t epoch)
      : id_(std::move(id)),
        epoch_(epoch),
        control_(v1::AgentControl::NewStub(MakeInsecureChannel(manager))) {}
  ~FakeAgent() { CloseStream(); }

  grpc::Status Register(const std::string& transport) {
    const ModelSpec spec = *FindModel("deepseek-v3");
    v1::RegisterAgentRequest req;
    req.set_agent_id(id_);
    req.set_tier(v1::TIER_GPU);
    ModelSpecToProto(spec, req.mutable_geometry()->mutable_spec());
    req.mutable_geometry()->set_bytes_per_block(spec.BytesPerPage());
    req.mutable_geometry()->set_num_blocks(4);
    req.set_capacity_bytes(4 * spec.BytesPerPage());
    req.set_epoch(epoch_);
    req.set_transport(transport);
    req.set_data_address("127.0.0.1:9");  // a transport pulls over a data port
    grpc::ClientContext ctx;
    v1::RegisterAgentResponse resp;
    return control_->Register(&ctx, req, &resp);
  }

  // Opens the Commands stream and reads it on a thread until CloseStream.
  void OpenStream() {
    stream_ = control_->Commands(&stream_ctx_);
    v1::AgentCommandAck hello;
    hello.set_agent_id(id_);
    hello.set_epoch(epoch_);
    ASSERT_TRUE(stream_->Write(hello));
    reader_ = std::thread([this] {
      v1::AgentCommand c;
      while (stream_->Read(&c)) {
        absl::MutexLock lock(&mu_);
        received_.push_back(c);
      }
    });
  }
  void CloseStream() {
    if (stream_ == nullptr) return;
    stream_ctx_.TryCancel();
    reader_.join();
    (void)stream_->Finish();
    stream_.reset();
  }

  grpc::Status Bootstrap(const std::string& peer, uint64_t link_id, const std::string& unique_id,
                         uint64_t epoch = 0) {
    v1::NcclBootstrapRequest req;
    req.set_agent_id(id_);
    req.set_epoch(epoch == 0 ? epoch_ : epoch);
    req.set_peer_agent_id(peer);
    req.set_link_id(link_id);
    req.set_unique_id(unique_id);
    grpc::ClientContext ctx;
    v1::NcclBootstrapResponse resp;
    return control_->NcclBootstrap(&ctx, req, &resp);
  }

  std::vector<v1::AgentCommand> received() {
    absl::MutexLock lock(&mu_);
    return received_;
  }
  const std::string& id() const { return id_; }

 private:
  const std::string id_;
  const uint64_t epoch_;
  std::unique_ptr<v1::AgentControl::Stub> control_;
  grpc::ClientContext stream_ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentCommandAck, v1::AgentCommand>> stream_;
  std::thread reader_;
  absl::Mutex mu_;
  std::vector<v1::AgentCommand> received_ ABSL_GUARDED_BY(mu_);
};

std::string Id(char fill) { return std::string(128, fill); }

class NcclBootstrapRpcTest : public ::testing::Test {
 protected:
  void StartManager(uint32_t heartbeat_timeout_ms = 10'000) {
    ServerOptions o;
    o.tls.insecure = true;
    o.listen_address = "127.0.0.1:0";
    o.metrics_address = "";
    o.shutdown_grace_ms = 100;
    o.agent_heartbeat_timeout_ms = heartbeat_timeout_ms;
    absl::StatusOr<std::unique_ptr<ManagerServer>> m = ManagerServer::Start(o);
    ASSERT_TRUE(m.ok()) << m.status();
    manager_ = *std::move(m);
  }

  std::unique_ptr<ManagerServer> manager_;
};

TEST_F(NcclBootstrapRpcTest, ThePeerReceivesTheIdAndBothRanksOnItsCommandStream) {
  StartManager();
  FakeAgent puller(manager_->address(), "gpu-0", 11);
  FakeAgent server(manager_->address(), "gpu-1", 22);
  ASSERT_TRUE(puller.Register("nccl").ok());
  ASSERT_TRUE(server.Register("nccl").ok());
  server.OpenStream();
  ASSERT_TRUE(WaitFor([&] { return manager_->commands().open_streams() == 1; }));

  const grpc::Status s = puller.Bootstrap("gpu-1", 0xfeed, Id('\x5a'));
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(WaitFor([&] { return server.received().size() == 1; }));
  const v1::AgentCommand c = server.received()[0];
  EXPECT_EQ(c.sequence(), 0u);  // not a numbered command: never acked, never resent
  EXPECT_NE(c.manager_incarnation(), 0u);
  ASSERT_TRUE(c.has_nccl_connect());
  EXPECT_EQ(c.nccl_connect().from_agent_id(), "gpu-0");
  EXPECT_EQ(c.nccl_connect().link_id(), 0xfeedu);
  EXPECT_EQ(c.nccl_connect().unique_id(), Id('\x5a'));
  EXPECT_EQ(c.nccl_connect().rank(), 1);
  EXPECT_EQ(c.nccl_connect().peer_rank(), 0);
  EXPECT_EQ(c.nccl_connect().nranks(), 2);
  EXPECT_EQ(manager_->nccl_relay().queued("gpu-1"), 0u);
  // The stream stays healthy: numbered commands still start at sequence 1 (the book is
  // untouched by offers).
  EXPECT_EQ(manager_->commands().unacked_commands("gpu-1"), 0u);
  EXPECT_EQ(manager_->commands().open_streams(), 1u);
}

TEST_F(NcclBootstrapRpcTest, EveryRefusalAnswersItsCodeAndQueuesNothing) {
  StartManager();
  FakeAgent puller(manager_->address(), "gpu-0", 11);
  FakeAgent server(manager_->address(), "gpu-1", 22);
  FakeAgent tcp_peer(manager_->address(), "gpu-2", 33);
  ASSERT_TRUE(puller.Register("nccl").ok());
  ASSERT_TRUE(server.Register("nccl").ok());
  ASSERT_TRUE(tcp_peer.Register("tcp").ok());
  server.OpenStream();
  tcp_peer.OpenStream();
  ASSERT_TRUE(WaitFor([&] { return manager_->commands().open_streams() == 2; }));

  struct Case {
    const char* what;
    grpc::Status status;
    grpc::StatusCode code;
    const char* field;
  };
  FakeAgent stranger(manager_->address(), "gpu-9", 99);  // never registered
  FakeAgent bad_id(manager_->address(), "bad id!", 1);
  const std::vector<Case> cases = {
      {"short id", puller.Bootstrap("gpu-1", 1, Id('a').substr(0, 127)),
       grpc::StatusCode::INVALID_ARGUMENT, "unique_id"},
      {"long id", puller.Bootstrap("gpu-1", 1, Id('a') + "x"), grpc::StatusCode::INVALID_ARGUMENT,
       "unique_id"},
      {"empty id", puller.Bootstrap("gpu-1", 1, ""), grpc::StatusCode::INVALID_ARGUMENT,
       "unique_id"},
      {"link 0", puller.Bootstrap("gpu-1", 0, Id('a')), grpc::StatusCode::INVALID_ARGUMENT,
       "link_id"},
      {"self", puller.Bootstrap("gpu-0", 1, Id('a')), grpc::StatusCode::INVALID_ARGUMENT,
       "peer_agent_id"},
      {"bad peer id", puller.Bootstrap("no such!", 1, Id('a')), grpc::StatusCode::INVALID_ARGUMENT,
       "peer_agent_id"},
      {"empty peer", puller.Bootstrap("", 1, Id('a')), grpc::StatusCode::INVALID_ARGUMENT,
       "peer_agent_id"},
      {"bad caller id", bad_id.Bootstrap("gpu-1", 1, Id('a')), grpc::StatusCode::INVALID_ARGUMENT,
       "agent_id"},
      {"unknown caller", stranger.Bootstrap("gpu-1", 1, Id('a')), grpc::StatusCode::NOT_FOUND,
       "agent_id"},
      {"stale epoch", puller.Bootstrap("gpu-1", 1, Id('a'), /*epoch=*/10),
       grpc::StatusCode::ABORTED, "epoch"},
      {"unknown peer", puller.Bootstrap("gpu-7", 1, Id('a')), grpc::StatusCode::NOT_FOUND,
       "peer_agent_id"},
      {"tcp peer", puller.Bootstrap("gpu-2", 1, Id('a')), grpc::StatusCode::FAILED_PRECONDITION,
       "peer_agent_id"},
      {"tcp caller", tcp_peer.Bootstrap("gpu-1", 1, Id('a')), grpc::StatusCode::FAILED_PRECONDITION,
       "agent_id"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.error_code(), c.code) << c.what << ": " << c.status.error_message();
    EXPECT_THAT(c.status.error_message(), HasSubstr(c.field)) << c.what;
  }
  EXPECT_EQ(manager_->nccl_relay().queued("gpu-1"), 0u);
  EXPECT_EQ(manager_->nccl_relay().queued("gpu-2"), 0u);

  // Nothing was queued: the next good offer is the first thing either peer receives.
  ASSERT_TRUE(puller.Bootstrap("gpu-1", 42, Id('g')).ok());
  ASSERT_TRUE(WaitFor([&] { return !server.received().empty(); }));
  absl::SleepFor(absl::Milliseconds(100));  // room for anything wrongly queued to arrive
  ASSERT_EQ(server.received().size(), 1u);
  EXPECT_EQ(server.received()[0].nccl_connect().link_id(), 42u);
  EXPECT_TRUE(tcp_peer.received().empty());
}

TEST_F(NcclBootstrapRpcTest, APeerWithoutAStreamIsUnavailableAndADeadPeerIsRefused) {
  StartManager(/*heartbeat_timeout_ms=*/300);
  FakeAgent puller(manager_->address(), "gpu-0", 11);
  FakeAgent server(manager_->address(), "gpu-1", 22);
  ASSERT_TRUE(puller.Register("nccl").ok());
  ASSERT_TRUE(server.Register("nccl").ok());
  // Registered and alive, but no Commands stream: the offer cannot be delivered now.
  const grpc::Status no_stream = puller.Bootstrap("gpu-1", 1, Id('a'));
  EXPECT_EQ(no_stream.error_code(), grpc::StatusCode::UNAVAILABLE) << no_stream.error_message();
  EXPECT_THAT(no_stream.error_message(), HasSubstr("peer_agent_id"));
  server.OpenStream();
  ASSERT_TRUE(WaitFor([&] { return manager_->commands().open_streams() == 1; }));

  // The peer stops heartbeating; the caller keeps registering (which counts as alive).
  absl::SleepFor(absl::Milliseconds(450));
  ASSERT_TRUE(puller.Register("nccl").ok());
  const grpc::Status dead = puller.Bootstrap("gpu-1", 2, Id('a'));
  EXPECT_TRUE(dead.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
              dead.error_code() == grpc::StatusCode::NOT_FOUND)
      << dead.error_message();
  EXPECT_THAT(dead.error_message(), HasSubstr("peer_agent_id"));
  EXPECT_EQ(manager_->nccl_relay().queued("gpu-1"), 0u);
  EXPECT_TRUE(server.received().empty());
}

}  // namespace
}  // namespace kvcm
