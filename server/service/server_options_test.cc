#include "server/service/server_options.h"

#include <cstdio>
#include <fstream>
#include <functional>
#include <string>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

void ExpectInvalid(const absl::Status& status, const std::string& message_part) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(message_part));
}

TEST(ServerOptionsTest, DefaultsAreValidOnceTransportSecurityIsChosen) {
  ServerOptions options;
  EXPECT_FALSE(options.tls.insecure);
  ExpectInvalid(options.Validate(), "no transport security");
  options.tls.insecure = true;
  EXPECT_TRUE(options.Validate().ok()) << options.Validate();
  EXPECT_EQ(options.listen_address, "127.0.0.1:50051");
  EXPECT_EQ(options.metrics_address, "127.0.0.1:9464");
  EXPECT_EQ(options.policy, "select");
  EXPECT_EQ(options.max_tokens_per_request, 1u << 20);
  EXPECT_EQ(options.max_pages_per_request, 65536u);
  EXPECT_EQ(options.max_message_bytes, 16u << 20);
  EXPECT_EQ(options.max_agent_epoch_ahead_s, 300u);
}

TEST(ServerOptionsTest, TheEpochBoundIsASecondToADay) {
  ServerOptions options;
  options.tls.insecure = true;
  for (uint32_t bad : {0u, 86'401u}) {
    options.max_agent_epoch_ahead_s = bad;
    ExpectInvalid(options.Validate(), "max_agent_epoch_ahead_s must be in [1, 86400]");
  }
  for (uint32_t good : {1u, 86'400u}) {
    options.max_agent_epoch_ahead_s = good;
    EXPECT_TRUE(options.Validate().ok()) << options.Validate();
  }
}

// Valid high-availability options on top of `o`.
void HaOptions(ServerOptions& o) {
  o.etcd_endpoints = "127.0.0.1:2379, etcd-1.etcd:2379";
  o.hash_secret_file = "/etc/kvcm/hash-secret/hex";
}

TEST(ServerOptionsTest, HighAvailabilityOptions) {
  ServerOptions options;
  options.tls.insecure = true;
  EXPECT_TRUE(options.EtcdEndpoints().empty());
  HaOptions(options);
  EXPECT_TRUE(options.Validate().ok()) << options.Validate();
  EXPECT_THAT(options.EtcdEndpoints(),
              ::testing::ElementsAre("127.0.0.1:2379", "etcd-1.etcd:2379"));
  EXPECT_TRUE(options.EtcdTls().insecure) << "no etcd_ca_file: plaintext to etcd";
  options.etcd_ca_file = "ca.pem";
  options.etcd_cert_file = "client.pem";
  options.etcd_key_file = "client.key";
  options.advertise_address = "10.0.0.7:50051";
  EXPECT_TRUE(options.Validate().ok()) << options.Validate();
  EXPECT_FALSE(options.EtcdTls().insecure);
  EXPECT_EQ(options.EtcdTls().cert_file, "client.pem");
}

TEST(ServerOptionsTest, ValidateNamesTheBadField) {
  struct Case {
    std::function<void(ServerOptions&)> mutate;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](ServerOptions& o) { o.listen_address = ""; }, "listen_address"},
      {[](ServerOptions& o) { o.listen_address = "localhost"; }, "listen_address"},
      {[](ServerOptions& o) { o.listen_address = "localhost:99999"; }, "listen_address"},
      {[](ServerOptions& o) { o.metrics_address = "9464x"; }, "metrics_address"},
      {[](ServerOptions& o) { o.metrics_address = "host:-1"; }, "metrics_address"},
      {[](ServerOptions& o) { o.policy = "fifo"; }, "policy"},
      {[](ServerOptions& o) { o.policy = "opt"; }, "policy"},  // clairvoyant: simulator only
      {[](ServerOptions& o) { o.max_lease_ttl_ms = 0; }, "max_lease_ttl_ms"},
      {[](ServerOptions& o) { o.default_lease_ttl_ms = 0; }, "default_lease_ttl_ms"},
      {[](ServerOptions& o) { o.default_lease_ttl_ms = o.max_lease_ttl_ms + 1; },
       "default_lease_ttl_ms"},
      {[](ServerOptions& o) { o.max_tokens_per_request = 0; }, "max_tokens_per_request"},
      {[](ServerOptions& o) { o.max_pages_per_request = 0; }, "max_pages_per_request"},
      {[](ServerOptions& o) { o.max_message_bytes = 100; }, "max_message_bytes"},
      {[](ServerOptions& o) { o.max_message_bytes = 0x80000000u; }, "max_message_bytes"},
      {[](ServerOptions& o) { o.limits.handshake_timeout_ms = 0; }, "grpc_handshake_timeout_ms"},
      {[](ServerOptions& o) { o.limits.max_concurrent_streams = 0; },
       "grpc_max_concurrent_streams"},
      {[](ServerOptions& o) { o.limits.memory_bytes = 1; }, "grpc_memory_bytes"},
      {[](ServerOptions& o) { o.limits.max_connections_per_peer = 0; },
       "grpc_max_connections_per_peer"},
      {[](ServerOptions& o) { o.limits.fd_reserve = 1; }, "grpc_fd_reserve"},
      {[](ServerOptions& o) { o.max_streams_per_principal = 0; }, "max_streams_per_principal"},
      {[](ServerOptions& o) { o.lease_sweep_interval_ms = 0; }, "lease_sweep_interval_ms"},
      {[](ServerOptions& o) { o.hash_secret_hex = "abc"; }, "hash_secret_hex"},
      {[](ServerOptions& o) { o.hash_secret_hex = std::string(31, 'a') + "g"; }, "hash_secret_hex"},
      {[](ServerOptions& o) { o.max_event_queue = 0; }, "max_event_queue"},
      {[](ServerOptions& o) { o.max_namespaces = 0; }, "max_namespaces"},
      {[](ServerOptions& o) { o.max_namespaces_per_tenant = 0; }, "max_namespaces_per_tenant"},
      {[](ServerOptions& o) { o.max_pins_per_tenant = 0; }, "max_pins_per_tenant"},
      {[](ServerOptions& o) { o.route_prefill_tokens_per_s = 0; }, "route_prefill_tokens_per_s"},
      {[](ServerOptions& o) { o.route_tcp_link_gbps = 0; }, "route_tcp_link_gbps"},
      {[](ServerOptions& o) { o.route_nccl_link_gbps = 0; }, "route_nccl_link_gbps"},
      {[](ServerOptions& o) { o.default_max_page_age_s = kMaxPageAgeS + 1; },
       "default_max_page_age_s"},
      {[](ServerOptions& o) { o.tls.ca_file = "ca.pem"; }, "insecure"},
      {[](ServerOptions& o) { o.tls.cert_file = "m.pem"; }, "insecure"},
      {[](ServerOptions& o) {
         o.tls.insecure = false;
         o.tls.key_file = "m.key";
       },
       "tls_cert_file"},
      {[](ServerOptions& o) {
         o.tls.insecure = false;
         o.tls.cert_file = "m.pem";
       },
       "tls_key_file"},
      {[](ServerOptions& o) {
         o.tls.insecure = false;
         o.tls.cert_file = "m.pem";
         o.tls.key_file = "m.key";
         o.tls.reload_interval_s = 0;
       },
       "tls_reload_interval_s"},
      {[](ServerOptions& o) {
         o.tenant_max_bytes = 1 << 20;
         o.tenant_max_pinned_bytes = (1 << 20) + 1;
       },
       "tenant_max_pinned_bytes"},
      {[](ServerOptions& o) { o.default_tenant_pool_share_pct = 0; },
       "default_tenant_pool_share_pct"},
      {[](ServerOptions& o) { o.default_tenant_pool_share_pct = 101; },
       "default_tenant_pool_share_pct"},
      {[](ServerOptions& o) { o.max_engine_pages_per_engine = 0; }, "max_engine_pages_per_engine"},
      {[](ServerOptions& o) { o.max_engine_pages_per_tenant = 0; }, "max_engine_pages_per_tenant"},
      // High availability: HaOptions() below is a valid base.
      {[](ServerOptions& o) { o.etcd_ca_file = "ca.pem"; }, "etcd_ca_file"},
      {[](ServerOptions& o) { o.advertise_address = "10.0.0.1:50051"; }, "advertise_address"},
      {[](ServerOptions& o) {
         HaOptions(o);
         o.etcd_endpoints = "127.0.0.1:2379,etcd";
       },
       "etcd_endpoints"},
      {[](ServerOptions& o) {
         HaOptions(o);
         o.hash_secret_file.clear();
       },
       "etcd_endpoints"},
      {[](ServerOptions& o) {
         HaOptions(o);
         o.etcd_lease_ttl_s = 1;
       },
       "etcd_lease_ttl_s"},
      {[](ServerOptions& o) {
         HaOptions(o);
         o.etcd_lease_ttl_s = 61;
       },
       "etcd_lease_ttl_s"},
      {[](ServerOptions& o) {
         HaOptions(o);
         o.etcd_election_key = "";
       },
       "etcd_election_key"},
      {[](ServerOptions& o) {
         HaOptions(o);
         o.advertise_address = "manager-0";
       },
       "advertise_address"},
      {[](ServerOptions& o) {
         HaOptions(o);
         o.etcd_cert_file = "client.pem";
         o.etcd_key_file = "client.key";
       },
       "etcd_cert_file"},
      {[](ServerOptions& o) {
         HaOptions(o);
         o.etcd_ca_file = "ca.pem";
         o.etcd_key_file = "client.key";
       },
       "etcd_cert_file"},
  };
  for (const Case& c : cases) {
    ServerOptions options;
    options.tls.insecure = true;
    c.mutate(options);
    absl::Status status = options.Validate();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field << ": " << status;
    EXPECT_THAT(std::string(status.message()), StartsWith(c.field + " ")) << status;
  }
}

TEST(ServerOptionsTest, AcceptedAddressForms) {
  ServerOptions options;
  options.tls.insecure = true;
  for (const char* address : {"[::]:50051", "0.0.0.0:0", ":7000", "unix:/tmp/kvcm.sock"}) {
    options.listen_address = address;
    EXPECT_TRUE(options.Validate().ok()) << address;
  }
  options.metrics_address = "";
  EXPECT_TRUE(options.Validate().ok()) << "empty metrics_address disables the exporter";
}

TEST(ServerOptionsTest, ToCacheIndexOptions) {
  ServerOptions options;
  options.tls.insecure = true;
  options.hash_secret_hex = "00112233445566778899aabbccddeeff";
  options.default_lease_ttl_ms = 1500;
  options.max_lease_ttl_ms = 9000;
  options.regret_window_ms = 42;
  options.default_pool_capacity_bytes = 123;
  options.default_max_page_age_s = 3600;
  options.tenant_max_bytes = 10 << 20;
  options.tenant_max_pinned_bytes = 4 << 20;
  options.default_tenant_pool_share_pct = 30;
  options.max_engine_pages_per_engine = 7;
  options.max_engine_pages_per_tenant = 9;
  absl::StatusOr<CacheIndexOptions> index = options.ToCacheIndexOptions();
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->hash_secret.ToBytes(),
            std::string("\x00\x11\x22\x33\x44\x55\x66\x77\x88\x99\xaa\xbb\xcc\xdd\xee\xff", 16));
  EXPECT_EQ(index->default_lease_ttl, absl::Milliseconds(1500));
  EXPECT_EQ(index->max_lease_ttl, absl::Milliseconds(9000));
  EXPECT_EQ(index->regret_window, absl::Milliseconds(42));
  EXPECT_EQ(index->default_pool_capacity_bytes, 123u);
  EXPECT_EQ(index->default_max_page_age, absl::Hours(1));
  EXPECT_EQ(index->tenant_max_bytes, 10u << 20);
  EXPECT_EQ(index->tenant_max_pinned_bytes, 4u << 20);
  EXPECT_EQ(index->default_tenant_pool_share_pct, 30u);
  EXPECT_EQ(index->max_engine_pages_per_engine, 7u);
  EXPECT_EQ(index->max_engine_pages_per_tenant, 9u);
  EXPECT_EQ(ServerOptions().tenant_max_bytes, 0u) << "no quota by default";
  EXPECT_EQ(ServerOptions().default_tenant_pool_share_pct, 50u) << "but a fair share";
  EXPECT_EQ(ServerOptions().max_engine_pages_per_engine,
            CacheIndexOptions().max_engine_pages_per_engine);
  EXPECT_EQ(ServerOptions().max_engine_pages_per_tenant,
            CacheIndexOptions().max_engine_pages_per_tenant);
  EXPECT_EQ(ServerOptions().default_max_page_age_s, 0u) << "no retention limit by default";
  EXPECT_EQ(index->policy, "select");
  EXPECT_TRUE(index->Validate().ok());

  // An empty secret draws a fresh random one each time.
  options.hash_secret_hex.clear();
  absl::StatusOr<CacheIndexOptions> a = options.ToCacheIndexOptions();
  absl::StatusOr<CacheIndexOptions> b = options.ToCacheIndexOptions();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE(a->hash_secret == b->hash_secret);

  options.max_event_queue = 0;
  ExpectInvalid(options.ToCacheIndexOptions().status(), "max_event_queue");
}

TEST(ServerOptionsTest, SetParsesEveryKind) {
  ServerOptions options;
  ASSERT_TRUE(options.Set("listen_address", "0.0.0.0:1234").ok());
  ASSERT_TRUE(options.Set("default_pool_capacity_bytes", "1099511627776").ok());
  ASSERT_TRUE(options.Set("max_event_queue", "17").ok());
  ASSERT_TRUE(options.Set("metrics_address", "").ok());
  EXPECT_EQ(options.listen_address, "0.0.0.0:1234");
  EXPECT_EQ(options.default_pool_capacity_bytes, 1ULL << 40);
  EXPECT_EQ(options.max_event_queue, 17u);
  EXPECT_EQ(options.metrics_address, "");

  ExpectInvalid(options.Set("max_widgets", "1"), "unknown option \"max_widgets\"");
  ExpectInvalid(options.Set("max_event_queue", "12x"),
                "max_event_queue: \"12x\" is not a 32-bit unsigned decimal number");
  ExpectInvalid(options.Set("max_event_queue", "-1"), "max_event_queue");
  ExpectInvalid(options.Set("max_event_queue", ""), "max_event_queue");
  ExpectInvalid(options.Set("max_event_queue", "4294967296"), "max_event_queue");
  ExpectInvalid(options.Set("default_pool_capacity_bytes", "1e9"),
                "default_pool_capacity_bytes: \"1e9\" is not a 64-bit unsigned");
  EXPECT_EQ(options.max_event_queue, 17u) << "a failed Set changes nothing";
}

TEST(ServerOptionsTest, EveryNameCanBeSet) {
  std::vector<absl::string_view> names = ServerOptions::Names();
  EXPECT_EQ(names.size(), 59u);
  for (absl::string_view name : names) {
    ServerOptions options;
    const bool is_text = name == "listen_address" || name == "metrics_address" ||
                         name == "policy" || name == "hash_secret_hex" ||
                         absl::EndsWith(name, "_file") || name == "etcd_endpoints" ||
                         name == "etcd_election_key" || name == "advertise_address" ||
                         name == "agent_identity_dns_suffix";
    const bool is_bool = name == "insecure";
    EXPECT_TRUE(options.Set(name, is_bool ? "true" : is_text ? "lru" : "5").ok()) << name;
    EXPECT_THAT(options.DebugString(), HasSubstr(std::string(name) + " = ")) << name;
  }
}

// The connection-limit and TLS options keep their flat names (flags, config files) and land
// in the structs the server takes.
TEST(ServerOptionsTest, LimitAndTlsNamesSetTheNestedStructs) {
  ServerOptions options;
  ASSERT_TRUE(options.Set("grpc_fd_reserve", "128").ok());
  ASSERT_TRUE(options.Set("grpc_memory_bytes", "33554432").ok());
  ASSERT_TRUE(options.Set("tls_key_file", "/etc/kvcm/m.key").ok());
  ASSERT_TRUE(options.Set("insecure", "true").ok());
  EXPECT_EQ(options.limits.fd_reserve, 128u);
  EXPECT_EQ(options.limits.memory_bytes, 33554432u);
  EXPECT_EQ(options.tls.key_file, "/etc/kvcm/m.key");
  EXPECT_TRUE(options.tls.insecure);
  EXPECT_THAT(options.DebugString(), HasSubstr("grpc_fd_reserve = 128\n"));
  EXPECT_THAT(options.DebugString(), HasSubstr("tls_key_file = \"/etc/kvcm/m.key\"\n"));
}

TEST(ServerOptionsTest, DebugStringRedactsTheSecret) {
  ServerOptions options;
  options.hash_secret_hex = "00112233445566778899aabbccddeeff";
  const std::string text = options.DebugString();
  EXPECT_THAT(text, HasSubstr("hash_secret_hex = (set)"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("00112233")));
  EXPECT_THAT(text, HasSubstr("listen_address = \"127.0.0.1:50051\""));
}

// The log says truthfully where the secret came from: a file is not "(random)".
TEST(ServerOptionsTest, DebugStringNamesTheSecretsSource) {
  ServerOptions options;
  EXPECT_THAT(options.DebugString(), HasSubstr("hash_secret_hex = (random)\n"));
  options.hash_secret_file = "/run/secrets/kvcm-hash";
  const std::string text = options.DebugString();
  EXPECT_THAT(text, HasSubstr("hash_secret_hex = (from hash_secret_file)\n"));
  EXPECT_THAT(text, HasSubstr("hash_secret_file = \"/run/secrets/kvcm-hash\""));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("(random)")));
}

TEST(ServerOptionsTest, ConfigText) {
  ServerOptions options;
  absl::Status s = options.MergeConfigText(
      "# kvcm-manager config\n"
      "\n"
      "listen_address = 0.0.0.0:6000   # all interfaces\n"
      "  metrics_address=\"\"\n"
      "policy = \"lru\"\n"
      "max_pages_per_request = 128\r\n"
      "default_pool_capacity_bytes = 4096\n"
      "insecure = true\n",
      "kvcm.conf");
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(options.listen_address, "0.0.0.0:6000");
  EXPECT_EQ(options.metrics_address, "");
  EXPECT_EQ(options.max_pages_per_request, 128u);
  EXPECT_EQ(options.default_pool_capacity_bytes, 4096u);
  EXPECT_TRUE(options.Validate().ok());
}

TEST(ServerOptionsTest, TransportSecurity) {
  ServerOptions options;
  const absl::Status none = options.Validate();
  ExpectInvalid(none, "pass --tls_cert_file and --tls_key_file (and --tls_ca_file for mutual TLS)");
  ExpectInvalid(none, "or --insecure to serve plaintext");

  ASSERT_TRUE(options.Set("tls_cert_file", "/etc/kvcm/m.pem").ok());
  ASSERT_TRUE(options.Set("tls_key_file", "/etc/kvcm/m.key").ok());
  EXPECT_TRUE(options.Validate().ok()) << "TLS without client certificates";
  ASSERT_TRUE(options.Set("tls_ca_file", "/etc/kvcm/ca.pem").ok());
  ASSERT_TRUE(options.Set("tls_reload_interval_s", "5").ok());
  EXPECT_TRUE(options.Validate().ok());
  const TlsOptions tls = options.tls;
  EXPECT_FALSE(tls.insecure);
  EXPECT_EQ(tls.cert_file, "/etc/kvcm/m.pem");
  EXPECT_EQ(tls.key_file, "/etc/kvcm/m.key");
  EXPECT_EQ(tls.ca_file, "/etc/kvcm/ca.pem");
  EXPECT_EQ(tls.reload_interval_s, 5u);
  EXPECT_TRUE(tls.ValidateForServer().ok());

  ASSERT_TRUE(options.Set("insecure", "1").ok());
  ExpectInvalid(options.Validate(), "insecure = true excludes tls_cert_file");
  ExpectInvalid(options.Set("insecure", "yes"), "insecure: \"yes\" is not true, false, 1 or 0");
  EXPECT_TRUE(options.tls.insecure) << "a failed Set changes nothing";
  ASSERT_TRUE(options.Set("insecure", "false").ok());
  EXPECT_FALSE(options.tls.insecure);
  EXPECT_THAT(options.DebugString(), HasSubstr("insecure = false\n"));
  EXPECT_THAT(options.DebugString(), HasSubstr("tls_ca_file = \"/etc/kvcm/ca.pem\"\n"));
}

TEST(ServerOptionsTest, ConfigErrorsCarryFileAndLine) {
  ServerOptions options;
  ExpectInvalid(options.MergeConfigText("policy = lru\n\nmax_cats = 3\n", "a.conf"),
                "a.conf:3: unknown option \"max_cats\"");
  ExpectInvalid(options.MergeConfigText("max_event_queue = ten\n", "b.conf"),
                "b.conf:1: max_event_queue: \"ten\" is not a 32-bit unsigned decimal number");
  ExpectInvalid(options.MergeConfigText("# ok\nlisten_address\n", "c.conf"),
                "c.conf:2: expected `name = value`");
  ExpectInvalid(options.MergeConfigText(" = 5\n", "d.conf"), "d.conf:1: missing option name");
  ExpectInvalid(options.MergeConfigText("policy = lru\npolicy = lru\n", "e.conf"),
                "e.conf:2: policy is set twice (first on line 1)");
  ExpectInvalid(options.MergeConfigText("policy = \"lru\n", "f.conf"),
                "f.conf:1: policy: unbalanced double quote");
}

TEST(ServerOptionsTest, ConfigFile) {
  ServerOptions options;
  EXPECT_EQ(options.MergeConfigFile("/nonexistent/kvcm.conf").code(), absl::StatusCode::kNotFound);

  const std::string path = ::testing::TempDir() + "/server_options_test.conf";
  {
    std::ofstream out(path);
    out << "max_event_queue = 9\nlease_sweep_interval_ms = 250\n";
  }
  ASSERT_TRUE(options.MergeConfigFile(path).ok());
  EXPECT_EQ(options.max_event_queue, 9u);
  EXPECT_EQ(options.lease_sweep_interval_ms, 250u);
  {
    std::ofstream out(path);
    out << "max_event_queue = 9\nbogus = 1\n";
  }
  ExpectInvalid(options.MergeConfigFile(path), path + ":2: unknown option \"bogus\"");
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvcm
