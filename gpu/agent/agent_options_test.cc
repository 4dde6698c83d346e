// AgentOptions' transport options, and Agent::Start's refusal of --transport=nccl where it
// cannot work (a build without NCCL, or a pool not on a CUDA device): both run on any CPU.
#include "gpu/agent/agent_options.h"

#include "gmock/gmock.h"
#include "gpu/agent/agent.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

TEST(AgentOptionsTest, TransportParsesTcpAndNcclOnly) {
  EXPECT_EQ(*ParseTransport("tcp"), TransportKind::kTcp);
  EXPECT_EQ(*ParseTransport("nccl"), TransportKind::kNccl);
  EXPECT_EQ(TransportName(TransportKind::kTcp), "tcp");
  EXPECT_EQ(TransportName(TransportKind::kNccl), "nccl");
  absl::StatusOr<TransportKind> bad = ParseTransport("rdma", "--transport");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--transport"));
  EXPECT_EQ(ParseTransport("NCCL").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AgentOptions().transport, TransportKind::kTcp);  // TCP stays the default
}

TEST(AgentOptionsTest, NcclOptionsAreValidated) {
  AgentOptions o;
  o.capacity_bytes = 1ull << 30;
  ASSERT_TRUE(o.Validate().ok());
  AgentOptions links = o;
  links.nccl_max_links = 0;
  EXPECT_THAT(links.Validate().message(), HasSubstr("nccl_max_links"));
  links.nccl_max_links = 1025;
  EXPECT_THAT(links.Validate().message(), HasSubstr("nccl_max_links"));
  AgentOptions timeout = o;
  timeout.nccl_connect_timeout_ms = 0;
  EXPECT_THAT(timeout.Validate().message(), HasSubstr("nccl_connect_timeout_ms"));
  // The staging must hold a block (4.3 MiB for DeepSeek-V3 bf16), but only matters for nccl.
  AgentOptions staging = o;
  staging.nccl_staging_bytes = 1 << 20;
  EXPECT_TRUE(staging.Validate().ok());
  staging.transport = TransportKind::kNccl;
  EXPECT_THAT(staging.Validate().message(), HasSubstr("nccl_staging_bytes"));
  staging.nccl_staging_bytes = staging.Geometry()->bytes_per_block();
  EXPECT_TRUE(staging.Validate().ok());
}

TEST(AgentNcclStartTest, NcclWithoutNcclOrWithoutADeviceIsRefusedCleanly) {
  AgentOptions o;
  o.agent_id = "gpu-9";
  o.manager_address = "127.0.0.1:1";  // never reached: the start fails first
  o.capacity_bytes = 64ull << 20;
  o.use_device = false;  // the host backend, whatever this machine has
  o.transport = TransportKind::kNccl;
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  ASSERT_FALSE(agent.ok());
  EXPECT_EQ(agent.status().code(), absl::StatusCode::kFailedPrecondition) << agent.status();
#ifdef KVCM_HAVE_NCCL
  EXPECT_THAT(agent.status().message(), HasSubstr("needs the pool on a CUDA device"));
#else
  EXPECT_THAT(agent.status().message(), HasSubstr("built without NCCL"));
#endif
  EXPECT_THAT(agent.status().message(), HasSubstr("--transport=tcp"));
  // The same options with tcp start.
  o.transport = TransportKind::kTcp;
  absl::StatusOr<std::unique_ptr<Agent>> tcp = Agent::Start(o);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  (*tcp)->Shutdown();
}

}  // namespace
}  // namespace kvcm
