#include "server/service/metrics.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/clock.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

class MetricsTest : public ::testing::Test {
 protected:
  MetricsTest() : hub_(8) {
    CacheIndexOptions options;
    options.hash_secret = HashKey{1, 2};
    options.clock = &clock_;
    index_ = *CacheIndex::Create(options);
    ModelSpec spec;  // MLA, 1 layer, (128 + 64) * 2 B per token, 4-token pages: 1536 B/page
    spec.num_layers = 1;
    spec.num_heads = 1;
    spec.kv_lora_rank = 128;
    spec.rope_dim = 64;
    spec.page_size_tokens = 4;
    EXPECT_TRUE(index_->RegisterModel(ns_, spec).ok());
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

TEST_F(MetricsTest, NamespaceSeriesAreBoundedWhateverClientsRegister) {
  CacheIndexOptions options;
  options.hash_secret = HashKey{1, 2};
  options.max_namespaces = 1000;
  options.max_namespaces_per_tenant = 1000;
  std::unique_ptr<CacheIndex> index = *CacheIndex::Create(options);
  ModelSpec spec;
  spec.num_layers = 1;
  spec.num_heads = 1;
  spec.kv_lora_rank = 128;
  spec.rope_dim = 64;
  spec.page_size_tokens = 4;
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

// The exposition passes Prometheus' own linter when promtool is installed
// (scripts/install-deps.sh installs it).
TEST_F(MetricsTest, PassesPromtoolCheckMetrics) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed";
  }
  ServiceMetrics metrics(index_.get(), &hub_);
  metrics.RecordRpc(Rpc::kStats, absl::StatusCode::kNotFound, absl::Milliseconds(1));
  const std::string path = ::testing::TempDir() + "/kvcm_metrics.prom";
  {
    std::ofstream out(path);
    out << metrics.RenderText();
  }
  const std::string command = "promtool check metrics < " + path + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[512];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) output.append(buf, n);
  const int status = pclose(pipe);
  EXPECT_EQ(status, 0) << output;
  EXPECT_EQ(output, "") << "promtool lint findings";
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvcm
