// AgentOptions' transport options, and Agent::Start's refusal of --transport=nccl where it
// cannot work (a build without NCCL, or a pool not on a CUDA device): both run on any CPU.
#include "gpu/agent/agent_options.h"

#include "gmock/gmock.h"
#include "gpu/agent/server/agent.h"
#include "gpu/agent/transport/registry.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

TEST(AgentOptionsTest, TransportsAreFoundByTheirRegisteredNameOnly) {
  std::vector<std::string> names;
  for (const TransportEntry& e : RegisteredTransports()) names.emplace_back(e.name);
  EXPECT_THAT(names, ::testing::ElementsAre("tcp", "nccl"));
  EXPECT_EQ((*FindTransport("tcp"))->name, "tcp");
  EXPECT_EQ((*FindTransport("nccl"))->name, "nccl");
  absl::StatusOr<const TransportEntry*> bad = FindTransport("rdma", "--transport");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--transport must be one of tcp, nccl"));
  EXPECT_EQ(FindTransport("NCCL").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AgentOptions().transport, "tcp");  // TCP stays the default
  AgentOptions o;
  o.tls.insecure = true;
  o.capacity_bytes = 1ull << 30;
  o.transport = "rdma";
  EXPECT_THAT(o.Validate().message(), HasSubstr("transport must be one of tcp, nccl"));
}

// The default tier is gpu whatever the pool's memory (AgentOptions::tier says why); a gpu
// pool in host memory is explained at start, not re-tiered.
TEST(AgentOptionsTest, AHostMemoryPoolKeepsTheGpuTierAndIsExplained) {
  EXPECT_EQ(AgentOptions{}.tier, Tier::kGpu);
  EXPECT_THAT(
      HostMemoryTierNote(Tier::kGpu, /*pool_on_device=*/false),
      ::testing::AllOf(::testing::HasSubstr("host memory"), ::testing::HasSubstr("tier gpu"),
                       ::testing::HasSubstr("--tier=host")));
  EXPECT_EQ(HostMemoryTierNote(Tier::kGpu, /*pool_on_device=*/true), "");
  EXPECT_EQ(HostMemoryTierNote(Tier::kHost, /*pool_on_device=*/false), "");
}

// A preset and explicit geometry together are refused, naming both; either alone works.
TEST(AgentOptionsTest, APresetAndExplicitGeometryAreNotMixed) {
  AgentOptions o;
  o.agent_id = "a";
  o.spec.num_layers = 32;
  o.spec.num_heads = 32;
  o.spec.num_kv_heads = 8;
  o.spec.head_dim = 128;
  o.spec.attention = AttentionKind::kGqa;
  const absl::StatusOr<PoolGeometry> mixed = o.Geometry();
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mixed.status().message(), HasSubstr("model"));
  EXPECT_THAT(mixed.status().message(), HasSubstr("--model= (empty)"));
  EXPECT_FALSE(o.Validate().ok());

  o.model.clear();  // the explicit geometry alone
  o.spec.page_size_tokens = o.page_size_tokens;
  o.spec.dtype = o.dtype;
  absl::StatusOr<PoolGeometry> explicit_only = o.Geometry();
  ASSERT_TRUE(explicit_only.ok()) << explicit_only.status();
  EXPECT_EQ(explicit_only->spec.num_layers, 32u);

  AgentOptions preset_only;  // the preset alone
  ASSERT_TRUE(preset_only.Geometry().ok());
  EXPECT_EQ(preset_only.Geometry()->spec.kv_lora_rank, 512u);
}

TEST(AgentOptionsTest, NcclOptionsAreValidated) {
  AgentOptions o;
  o.tls.insecure = true;
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
  staging.transport = "nccl";
  EXPECT_THAT(staging.Validate().message(), HasSubstr("nccl_staging_bytes"));
  staging.nccl_staging_bytes = staging.Geometry()->bytes_per_block();
  EXPECT_TRUE(staging.Validate().ok());
}

TEST(AgentOptionsTest, LocalSocketOptionsAreValidated) {
  AgentOptions o;
  o.tls.insecure = true;
  EXPECT_TRUE(o.local_socket.empty());  // off by default
  EXPECT_EQ(o.local_max_sessions, 64u);
  o.local_socket = "/tmp/kvcm-agent.sock";
  EXPECT_TRUE(o.Validate().ok());
  AgentOptions sessions = o;
  sessions.local_max_sessions = 0;
  EXPECT_THAT(sessions.Validate().message(), HasSubstr("local_max_sessions"));
  sessions.local_max_sessions = 4097;
  EXPECT_THAT(sessions.Validate().message(), HasSubstr("local_max_sessions"));
  AgentOptions path = o;
  path.local_socket = "/" + std::string(107, 'a');  // 108 bytes: no room for sun_path's NUL
  EXPECT_THAT(path.Validate().message(), HasSubstr("local_socket"));
  // Issue 35's limits: safe defaults, each validated by name.
  EXPECT_TRUE(o.local_allowed_uids.empty() && o.local_allowed_gids.empty());  // own uid only
  EXPECT_TRUE(o.local_socket_group.empty());                                  // mode 0600
  EXPECT_EQ(o.local_max_sessions_per_uid, 16u);
  EXPECT_EQ(o.local_hello_timeout_ms, 2000u);
  EXPECT_EQ(o.local_copy_chunk_bytes, 1u << 20);
  AgentOptions bad = o;
  bad.local_max_sessions_per_uid = 0;
  EXPECT_THAT(bad.Validate().message(), HasSubstr("local_max_sessions_per_uid"));
  bad = o;
  bad.local_hello_timeout_ms = 0;
  EXPECT_THAT(bad.Validate().message(), HasSubstr("local_hello_timeout_ms"));
  bad = o;
  bad.local_copy_chunk_bytes = 0;
  EXPECT_THAT(bad.Validate().message(), HasSubstr("local_copy_chunk_bytes"));
  for (const char* text : {"acme", "acme=", "=1000", "acme=x", "acme=1,acme=2"}) {
    bad = o;
    bad.local_principal_uids = text;
    EXPECT_THAT(bad.Validate().message(), HasSubstr("local_principal_uids")) << text;
  }
  absl::StatusOr<LocalPrincipalUids> bound =
      ParseLocalPrincipalUids("acme-vllm=1001:1002, globex-vllm=1003");
  ASSERT_TRUE(bound.ok()) << bound.status();
  EXPECT_EQ(bound->size(), 2u);
  EXPECT_EQ(bound->at("acme-vllm"), (std::vector<uint32_t>{1001, 1002}));
  EXPECT_EQ(bound->at("globex-vllm"), (std::vector<uint32_t>{1003}));
  EXPECT_TRUE(ParseLocalPrincipalUids("")->empty());
}

TEST(AgentOptionsTest, ConnectionLimitsAreValidatedByName) {
  struct Case {
    void (*set)(AgentOptions&);
    const char* name;
  };
  const Case cases[] = {
      {[](AgentOptions& o) { o.limits.handshake_timeout_ms = 0; }, "grpc_handshake_timeout_ms"},
      {[](AgentOptions& o) { o.limits.max_concurrent_streams = 0; }, "grpc_max_concurrent_streams"},
      {[](AgentOptions& o) { o.limits.max_connections = 0; }, "grpc_max_connections"},
      {[](AgentOptions& o) { o.limits.fd_reserve = 0; }, "grpc_fd_reserve"},
      {[](AgentOptions& o) { o.data_max_connections = 0; }, "data_max_connections"},
      {[](AgentOptions& o) { o.data_max_connections_per_peer = 0; },
       "data_max_connections_per_peer"},
      {[](AgentOptions& o) { o.data_request_timeout_ms = 0; }, "data_request_timeout_ms"},
      {[](AgentOptions& o) { o.data_max_handshakes = 0; }, "data_max_handshakes"},
      {[](AgentOptions& o) { o.data_max_handshakes_per_peer = 0; }, "data_max_handshakes_per_peer"},
      {[](AgentOptions& o) { o.data_handshake_timeout_ms = 0; }, "data_handshake_timeout_ms"},
  };
  for (const Case& c : cases) {
    AgentOptions o;
    o.tls.insecure = true;
    ASSERT_TRUE(o.Validate().ok());
    c.set(o);
    EXPECT_TRUE(absl::IsInvalidArgument(o.Validate())) << c.name;
    EXPECT_THAT(o.Validate().message(), HasSubstr(c.name));
  }
}

TEST(AgentOptionsTest, MaxStreamsPerPrincipalIsValidated) {
  AgentOptions o;
  o.tls.insecure = true;
  ASSERT_TRUE(o.Validate().ok());
  EXPECT_EQ(o.max_streams_per_principal, 16u);
  o.max_streams_per_principal = 0;
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.Validate().message(), HasSubstr("max_streams_per_principal"));
  o.max_streams_per_principal = 65'537;
  EXPECT_THAT(o.Validate().message(), HasSubstr("max_streams_per_principal"));
  o.max_streams_per_principal = 1;
  EXPECT_TRUE(o.Validate().ok());
}

TEST(AgentOptionsTest, TransportSecurityIsRequired) {
  AgentOptions o;
  o.capacity_bytes = 1ull << 30;
  absl::Status none = o.Validate();
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.message(),
              HasSubstr("set tls_cert_file, tls_key_file and tls_ca_file (mutual TLS), or "
                        "insecure = true"));
  o.tls.cert_file = "a.pem";
  o.tls.key_file = "a.key";
  EXPECT_THAT(o.Validate().message(), HasSubstr("tls_ca_file is required"));
  o.tls.ca_file = "ca.pem";
  EXPECT_TRUE(o.Validate().ok()) << "files are read at Start";
  EXPECT_EQ(o.tls.ca_file, "ca.pem");
  EXPECT_FALSE(o.tls.insecure);
  o.tls.reload_interval_s = 0;
  EXPECT_THAT(o.Validate().message(), HasSubstr("tls_reload_interval_s"));
  o.tls.reload_interval_s = 60;
  o.tls.insecure = true;
  EXPECT_THAT(o.Validate().message(), HasSubstr("insecure = true excludes tls_cert_file"));

  AgentOptions plain;
  plain.tls.insecure = true;
  plain.capacity_bytes = 1ull << 30;
  EXPECT_TRUE(plain.Validate().ok());
  plain.token = "t";
  plain.token_file = "token";
  EXPECT_THAT(plain.Validate().message(), HasSubstr("token_file excludes"));
  plain.token_file.clear();
  plain.token = "has space";
  EXPECT_THAT(plain.Validate().message(), HasSubstr("token"));
}

TEST(AgentTlsStartTest, UnreadableFilesAreNamedAtStart) {
  AgentOptions o;
  o.agent_id = "gpu-8";
  o.manager_address = "127.0.0.1:1";
  o.capacity_bytes = 64ull << 20;
  o.use_device = false;
  o.tls.cert_file = "/nonexistent/agent.pem";
  o.tls.key_file = "/nonexistent/agent.key";
  o.tls.ca_file = "/nonexistent/ca.pem";
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Start(o);
  EXPECT_EQ(agent.status().code(), absl::StatusCode::kInvalidArgument) << agent.status();
  EXPECT_THAT(agent.status().message(), HasSubstr("tls_ca_file \"/nonexistent/ca.pem\""));

  AgentOptions token = o;
  token.tls.cert_file = token.tls.key_file = token.tls.ca_file = "";
  token.tls.insecure = true;
  token.token_file = "/nonexistent/token";
  agent = Agent::Start(token);
  EXPECT_EQ(agent.status().code(), absl::StatusCode::kInvalidArgument) << agent.status();
  EXPECT_THAT(agent.status().message(), HasSubstr("token_file \"/nonexistent/token\""));
}

TEST(AgentNcclStartTest, NcclWithoutNcclOrWithoutADeviceIsRefusedCleanly) {
  AgentOptions o;
  o.tls.insecure = true;
  o.agent_id = "gpu-9";
  o.manager_address = "127.0.0.1:1";  // never reached: the start fails first
  o.capacity_bytes = 64ull << 20;
  o.use_device = false;  // the host backend, whatever this machine has
  o.transport = "nccl";
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
  o.transport = "tcp";
  absl::StatusOr<std::unique_ptr<Agent>> tcp = Agent::Start(o);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  (*tcp)->Shutdown();
}

}  // namespace
}  // namespace kvcm
