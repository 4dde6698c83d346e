#include "server/service/metrics.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/agent_registry.h"
#include "server/core/clock.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

// What `promtool check metrics` says of an exposition: "" when it passes (or when promtool
// is not installed: scripts/install-deps.sh installs it).
std::string PromtoolFindings(const std::string& text) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) return "";
  const std::string path = ::testing::TempDir() + "/kvcm_metrics.prom";
  {
    std::ofstream out(path);
    out << text;
  }
  const std::string command = "promtool check metrics < " + path + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return "popen failed";
  std::string output;
  char buf[512];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) output.append(buf, n);
  const int status = pclose(pipe);
  std::remove(path.c_str());
  if (status != 0 && output.empty()) return absl::StrCat("promtool exited with ", status);
  return output;
}

// MLA, 1 layer, (128 + 64) * 2 B per token, 4-token pages: 1536 B/page.
ModelSpec TinyMla() {
  ModelSpec spec;
  spec.num_layers = 1;
  spec.num_heads = 1;
  spec.kv_lora_rank = 128;
  spec.rope_dim = 64;
  spec.page_size_tokens = 4;
  return spec;
}

class MetricsTest : public ::testing::Test {
 protected:
  MetricsTest() : hub_(8) {
    CacheIndexOptions options;
    options.hash_secret = HashKey{1, 2};
    options.clock = &clock_;
    index_ = *CacheIndex::Create(options);
    EXPECT_TRUE(index_->RegisterModel(ns_, TinyMla()).ok());
    EXPECT_TRUE(index_->SetPoolCapacity(PoolKey{"gpu-0", Tier::kGpu}, 4 * 1536).ok());
  }

  FakeClock clock_;
  EventHub hub_;
  std::unique_ptr<CacheIndex> index_;
  NamespaceId ns_{"acme", "dsv3"};
};

TEST_F(MetricsTest, IndexSnapshotAtScrapeTime) {
  ServiceMetrics metrics(index_.get(), &hub_);
  std::vector<int32_t> tokens(12, 5);
  absl::StatusOr<std::vector<PageHash>> pages = index_->HashTokens(ns_, tokens);
  ASSERT_TRUE(pages.ok());
  std::vector<BlockId> blocks = {0, 1, 2};
  ASSERT_TRUE(index_->Insert(ns_, *pages, PoolKey{"gpu-0", Tier::kGpu}, blocks).ok());
  ASSERT_TRUE(index_->Match(ns_, *pages, MatchOptions{}).ok());

  const std::string text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr("kvcm_pool_capacity_bytes{agent=\"gpu-0\",tier=\"gpu\"} 6144"));
  EXPECT_THAT(text, HasSubstr("kvcm_pool_used_bytes{agent=\"gpu-0\",tier=\"gpu\"} 4608"));
  EXPECT_THAT(text, HasSubstr("kvcm_pool_usage_ratio{agent=\"gpu-0\",tier=\"gpu\"} 0.75"));
  EXPECT_THAT(text, HasSubstr("kvcm_pool_pages{agent=\"gpu-0\",tier=\"gpu\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvcm_namespace_pages{model=\"dsv3\",tenant=\"acme\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvcm_match_requests_total 1"));
  EXPECT_THAT(text, HasSubstr("kvcm_matched_tokens_total 12"));
  EXPECT_THAT(text, HasSubstr("kvcm_prefill_tokens_saved_total 12"));
  EXPECT_THAT(text, HasSubstr("kvcm_hit_ratio 1"));
  EXPECT_THAT(text, HasSubstr("kvcm_pages_inserted_total 3"));
  EXPECT_THAT(text, HasSubstr("kvcm_build_info{policy=\"lru\",version=\""));
}

TEST_F(MetricsTest, PerTenantAndPerNamespaceSeries) {
  ServiceMetrics metrics(index_.get(), &hub_);
  std::vector<int32_t> tokens(12, 5);
  absl::StatusOr<std::vector<PageHash>> pages = index_->HashTokens(ns_, tokens);
  ASSERT_TRUE(pages.ok());
  std::vector<BlockId> blocks = {0, 1};
  const PoolKey pool{"gpu-0", Tier::kGpu};
  ASSERT_TRUE(index_->Insert(ns_, std::span<const PageHash>(*pages).first(2), pool, blocks).ok());
  MatchOptions pin;
  pin.pin = true;
  ASSERT_TRUE(index_->Match(ns_, *pages, pin).ok());  // 8 of 12 tokens, pinned
  ASSERT_TRUE(index_->Reserve(pool, 1000, "").ok());

  const std::string text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr("kvcm_namespace_requested_tokens_total{model=\"dsv3\","
                              "tenant=\"acme\"} 12"));
  EXPECT_THAT(text, HasSubstr("kvcm_namespace_matched_tokens_total{model=\"dsv3\","
                              "tenant=\"acme\"} 8"));
  EXPECT_THAT(text, HasSubstr("kvcm_tenant_stored_bytes{tenant=\"acme\"} 3072"));
  EXPECT_THAT(text, HasSubstr("kvcm_tenant_pinned_bytes{tenant=\"acme\"} 3072"));
  EXPECT_THAT(text, HasSubstr("kvcm_tenant_pins{tenant=\"acme\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvcm_tenant_namespaces{tenant=\"acme\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvcm_tenant_reserved_bytes{tenant=\"_operator\"} 1000"));
  EXPECT_THAT(text, HasSubstr("kvcm_tenant_max_bytes 0"));
}

TEST_F(MetricsTest, PerAgentLivenessAndEpochs) {
  AgentRegistry agents(&clock_, absl::Seconds(10));
  for (const char* id : {"gpu-0", "gpu-1", "gpu-2"}) {
    AgentRegistration reg;
    reg.agent_id = id;
    reg.epoch = 1700000000123456;
    reg.capacity_bytes = 1 << 20;
    ASSERT_TRUE(agents.Register(reg).ok());
  }
  clock_.Advance(absl::Seconds(4));
  ASSERT_TRUE(agents.Heartbeat("gpu-1", 1700000000123456, AgentUsage{}).ok());
  ASSERT_TRUE(agents.Heartbeat("gpu-2", 1700000000123456, AgentUsage{}).ok());
  clock_.Advance(absl::Seconds(2));  // gpu-0 silent 6 s: suspect
  ASSERT_TRUE(agents.Heartbeat("gpu-2", 1700000000123456, AgentUsage{}).ok());
  ServiceMetrics metrics(index_.get(), &hub_, &agents);

  std::string text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr("kvcm_agents{state=\"alive\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvcm_agents_suspect 1"));
  EXPECT_THAT(text, HasSubstr("kvcm_agent_heartbeat_timeout_seconds 10"));
  EXPECT_THAT(text, HasSubstr("kvcm_agent_last_heartbeat_age_seconds{agent=\"gpu-0\"} 6"));
  EXPECT_THAT(text, HasSubstr("kvcm_agent_last_heartbeat_age_seconds{agent=\"gpu-1\"} 2"));
  EXPECT_THAT(text, HasSubstr("kvcm_agent_epoch{agent=\"gpu-1\"} 1700000000123456"));
  EXPECT_THAT(text, HasSubstr("kvcm_agent_up{agent=\"gpu-0\"} 1"));

  clock_.Advance(absl::Seconds(5));  // gpu-0 silent 11 s: gone
  text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr("kvcm_agent_up{agent=\"gpu-0\"} 0"));
  EXPECT_THAT(text, HasSubstr("kvcm_agents{state=\"gone\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvcm_agents_suspect 1"));  // gpu-1, silent 7 s
}

TEST_F(MetricsTest, NamespaceSeriesAreBoundedWhateverClientsRegister) {
  CacheIndexOptions options;
  options.hash_secret = HashKey{1, 2};
  options.max_namespaces = 1000;
  options.max_namespaces_per_tenant = 1000;
  std::unique_ptr<CacheIndex> index = *CacheIndex::Create(options);
  const ModelSpec spec = TinyMla();
  const PoolKey pool{"gpu-0", Tier::kGpu};
  ASSERT_TRUE(index->SetPoolCapacity(pool, 1 << 20).ok());
  // One namespace with pages (it must keep its own series), then many empty ones.
  const NamespaceId big{"big", "m"};
  ASSERT_TRUE(index->RegisterModel(big, spec).ok());
  std::vector<int32_t> tokens(8, 3);
  std::vector<BlockId> blocks = {0, 1};
  ASSERT_TRUE(index->Insert(big, *index->HashTokens(big, tokens), pool, blocks).ok());
  for (int i = 0; i < 600; ++i) {
    ASSERT_TRUE(index->RegisterModel(NamespaceId{absl::StrCat("t", i), "m"}, spec).ok());
  }
  ServiceMetrics metrics(index.get(), &hub_);
  const std::string text = metrics.RenderText();
  size_t series = 0;
  for (size_t at = text.find("\nkvcm_namespace_pages{"); at != std::string::npos;
       at = text.find("\nkvcm_namespace_pages{", at + 1)) {
    ++series;
  }
  EXPECT_EQ(series, kMaxNamespaceSeries + 1);
  EXPECT_THAT(text, HasSubstr("kvcm_namespace_pages{model=\"m\",tenant=\"big\"} 2"));
  EXPECT_THAT(text, HasSubstr("kvcm_namespace_pages{model=\"_other\",tenant=\"_other\"} 0"));
  // A tenant per namespace here: tenants are bounded the same way.
  series = 0;
  for (size_t at = text.find("\nkvcm_tenant_stored_bytes{"); at != std::string::npos;
       at = text.find("\nkvcm_tenant_stored_bytes{", at + 1)) {
    ++series;
  }
  EXPECT_EQ(series, kMaxNamespaceSeries + 1);
  EXPECT_THAT(text, HasSubstr("kvcm_tenant_stored_bytes{tenant=\"big\"} 3072"));
  EXPECT_THAT(text, HasSubstr("kvcm_tenant_stored_bytes{tenant=\"_other\"} 0"));
}

// The samples of one metric family in the exposition: labels (as written) -> value.
std::map<std::string, double> Samples(const std::string& text, const std::string& name) {
  std::map<std::string, double> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name, 0) != 0) continue;
    const std::string rest = line.substr(name.size());
    if (rest.empty() || (rest[0] != '{' && rest[0] != ' ')) continue;  // a longer name
    const size_t space = rest.rfind(' ');
    out[rest.substr(0, space)] = std::stod(rest.substr(space + 1));
  }
  return out;
}

// Policy "select": its choice, each candidate's miniature hit ratio and its sample, after
// prompts served as a worker would (a Match by the GPU pool's agent, then an Insert).
TEST_F(MetricsTest, SelectsChoiceAndItsMiniatureCaches) {
  CacheIndexOptions options;
  options.hash_secret = HashKey{1, 2};
  options.clock = &clock_;
  options.policy = "select";
  std::unique_ptr<CacheIndex> index = *CacheIndex::Create(options);
  const ModelSpec spec = TinyMla();
  ASSERT_TRUE(index->RegisterModel(ns_, spec).ok());
  const PoolKey gpu{"gpu-0", Tier::kGpu};
  ASSERT_TRUE(index->SetPoolCapacity(gpu, 64 * 1536).ok());
  BlockId next_block = 0;
  for (int round = 0; round < 3; ++round) {
    for (int32_t prompt = 0; prompt < 4; ++prompt) {
      const std::vector<PageHash> pages =
          *index->HashTokens(ns_, std::vector<int32_t>(12, 100 + prompt));
      ASSERT_TRUE(index->Match(ns_, pages, {.requester_agent_id = gpu.agent_id}).ok());
      std::vector<BlockId> blocks(pages.size());
      for (BlockId& b : blocks) b = next_block++;
      ASSERT_TRUE(index->Insert(ns_, pages, gpu, blocks).ok());
    }
  }
  ServiceMetrics metrics(index.get(), &hub_);
  const std::string text = metrics.RenderText();

  const std::map<std::string, double> choice = Samples(text, "kvcm_policy_choice");
  EXPECT_THAT(choice, ::testing::ElementsAre(::testing::Pair("{candidate=\"adaptive\"}", 0),
                                             ::testing::Pair("{candidate=\"conversation\"}", 1),
                                             ::testing::Pair("{candidate=\"cost\"}", 0),
                                             ::testing::Pair("{candidate=\"density\"}", 0),
                                             ::testing::Pair("{candidate=\"lru\"}", 0)))
      << "exactly one candidate is chosen: the starting one (SelectParams::initial) until a "
         "dwell of lookups has passed";
  const std::map<std::string, double> hit = Samples(text, "kvcm_policy_shadow_hit_ratio");
  ASSERT_EQ(hit.size(), 5u);
  for (const auto& [labels, ratio] : hit) {
    // 12 of 36 looked-up pages missed (the first round): every miniature cache, large
    // enough for all 4 prompts, held the other 24.
    EXPECT_GT(ratio, 0.5) << labels;
    EXPECT_LE(ratio, 1.0) << labels;
  }
  EXPECT_THAT(text, HasSubstr("# TYPE kvcm_policy_moves_total counter\nkvcm_policy_moves_total 0"));
  EXPECT_THAT(text, HasSubstr("kvcm_policy_sampled_pages_total{kind=\"lookup\"} 36\n"));
  EXPECT_THAT(text, HasSubstr("kvcm_policy_sampled_pages_total{kind=\"store\"} 36\n"));
  // A 64-page pool is simulated whole: 12 distinct pages in each of the 5 miniature caches.
  EXPECT_THAT(text, HasSubstr("kvcm_policy_shadow_pages 60\n"));
  EXPECT_THAT(text, HasSubstr("kvcm_policy_min_sample_rate 1\n"));
  EXPECT_THAT(text, HasSubstr("kvcm_build_info{policy=\"select\""));
  EXPECT_EQ(PromtoolFindings(text), "");

  // Another policy has no choice to report.
  EXPECT_THAT(ServiceMetrics(index_.get(), &hub_).RenderText(),
              ::testing::Not(HasSubstr("kvcm_policy_")));
}

TEST_F(MetricsTest, RpcCountersByCode) {
  ServiceMetrics metrics(index_.get(), &hub_);
  metrics.RecordRpc(Rpc::kMatch, absl::StatusCode::kOk, absl::Microseconds(30));
  metrics.RecordRpc(Rpc::kMatch, absl::StatusCode::kInvalidArgument, absl::Microseconds(10));
  metrics.RecordRpc(Rpc::kMatch, absl::StatusCode::kInvalidArgument, absl::Microseconds(10));
  metrics.RecordStreamEnd(Rpc::kWatchEvents, absl::StatusCode::kResourceExhausted);
  const std::string text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr("kvcm_rpc_requests_total{code=\"OK\",rpc=\"Match\"} 1"));
  EXPECT_THAT(text,
              HasSubstr("kvcm_rpc_requests_total{code=\"INVALID_ARGUMENT\",rpc=\"Match\"} 2"));
  EXPECT_THAT(text, HasSubstr("kvcm_rpc_requests_total{code=\"RESOURCE_EXHAUSTED\","
                              "rpc=\"WatchEvents\"} 1"));
  EXPECT_THAT(text, HasSubstr("kvcm_rpc_duration_seconds_count{rpc=\"Match\"} 3"));
  EXPECT_THAT(text, HasSubstr("kvcm_rpc_duration_seconds_bucket{rpc=\"Match\",le=\"2.5e-05\"} 2"));
  EXPECT_THAT(text,
              ::testing::Not(HasSubstr("kvcm_rpc_duration_seconds_count{rpc=\"WatchEvents\"")));
}

// The labels come from the services' descriptors; this pins them (dashboards and alerts use
// them) and the enum's order, so a new method fails here until Rpc has its entry.
TEST(RpcLabelsTest, EveryMethodHasItsLabel) {
  const std::vector<std::pair<Rpc, std::string>> expected = {
      {Rpc::kRegisterModel, "RegisterModel"},
      {Rpc::kMatch, "Match"},
      {Rpc::kInsert, "Insert"},
      {Rpc::kRelease, "Release"},
      {Rpc::kRenewLease, "RenewLease"},
      {Rpc::kRoute, "Route"},
      {Rpc::kEvict, "Evict"},
      {Rpc::kReserve, "Reserve"},
      {Rpc::kUnreserve, "Unreserve"},
      {Rpc::kStats, "Stats"},
      {Rpc::kWatchEvents, "WatchEvents"},
      {Rpc::kDeleteNamespace, "DeleteNamespace"},
      {Rpc::kPublishEngineEvents, "PublishEngineEvents"},
      {Rpc::kForgetAgent, "ForgetAgent"},
      {Rpc::kRegisterAgent, "RegisterAgent"},
      {Rpc::kHeartbeat, "Heartbeat"},
      {Rpc::kReportInventory, "ReportInventory"},
      {Rpc::kNcclBootstrap, "NcclBootstrap"},
      {Rpc::kLookupAgent, "LookupAgent"},
      {Rpc::kMakeRoom, "MakeRoom"},
  };
  ASSERT_EQ(LabelledMethods().size(), static_cast<size_t>(kNumRpcs))
      << "a method was added to CacheManager or AgentControl: give it an Rpc entry";
  ASSERT_EQ(expected.size(), static_cast<size_t>(kNumRpcs));
  for (const auto& [rpc, label] : expected) {
    EXPECT_EQ(RpcName(rpc), label);
  }
  EXPECT_EQ(RpcName(static_cast<Rpc>(kNumRpcs)), "unknown");
}

// The exposition passes Prometheus' own linter when promtool is installed
// (scripts/install-deps.sh installs it).
TEST_F(MetricsTest, PassesPromtoolCheckMetrics) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed";
  }
  AgentRegistry agents(&clock_, absl::Seconds(10));
  AgentRegistration reg;
  reg.agent_id = "gpu-0";
  reg.epoch = 1;
  ASSERT_TRUE(agents.Register(reg).ok());
  ServiceMetrics metrics(index_.get(), &hub_, &agents);
  metrics.RecordRpc(Rpc::kStats, absl::StatusCode::kNotFound, absl::Milliseconds(1));
  EXPECT_EQ(PromtoolFindings(metrics.RenderText()), "");
}

}  // namespace
}  // namespace kvcm
