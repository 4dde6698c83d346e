// AgentMetrics: what kvcm-agent's /metrics shows of its pool, its epoch and its pulls.
#include "gpu/agent/server/agent_metrics.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/agent_pools.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

TEST(AgentMetricsTest, PoolBlocksAndEpoch) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 4);
  AgentEpoch epoch;
  AgentMetrics metrics("gpu-0", AgentPools{.main = pool.get()}, &epoch);
  ASSERT_TRUE(pool->Allocate(3, epoch.current(), nullptr).ok());

  const std::string labels =
      absl::StrCat("{agent=\"gpu-0\",backend=\"", pool->backend().name(), "\"} ");
  const std::string text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvcm_agent_pool_blocks", labels, "4")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvcm_agent_pool_free_blocks", labels, "1")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvcm_agent_pool_committed_blocks", labels, "0")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvcm_agent_registered", labels, "0")));
  // The epoch is microseconds since 1970, printed exactly.
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvcm_agent_local_epoch", labels, epoch.current())));
  // The BlockAgent port's connection guard and gRPC log limiter, one family each.
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvcm_agent_grpc_connections_accepted_total", labels)));
  EXPECT_THAT(text, HasSubstr("kvcm_agent_grpc_connections_refused_total{agent=\"gpu-0\""));
  EXPECT_THAT(text, HasSubstr("reason=\"grpc_max_connections_per_peer\"}"));
  EXPECT_EQ(text.find("# TYPE kvcm_agent_grpc_connections_refused_total"),
            text.rfind("# TYPE kvcm_agent_grpc_connections_refused_total"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvcm_agent_grpc_log_lines_suppressed_total", labels)));
}

TEST(AgentMetricsTest, DataPortConnectionsByReason) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 4);
  AgentEpoch epoch;
  AgentMetrics metrics("gpu-0", AgentPools{.main = pool.get()}, &epoch);
  DataPortCounters& d = *metrics.data_port_counters();
  d.accepted += 9;
  d.served += 2;
  d.handshakes_evicted += 3;
  d.refused_max_handshakes += 4;
  const std::string text = metrics.RenderText();
  const std::string labels =
      absl::StrCat("{agent=\"gpu-0\",backend=\"", pool->backend().name(), "\"");
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("kvcm_agent_data_connections_accepted_total", labels, "} 9")));
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("kvcm_agent_data_connections_served_total", labels, "} 2")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvcm_agent_data_connections_closed_total", labels,
                                           ",reason=\"handshake_evicted\"} 3")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvcm_agent_data_connections_closed_total", labels,
                                           ",reason=\"data_max_handshakes\"} 4")));
}

TEST(AgentMetricsTest, TransfersBySuccessAndFailureReason) {
  std::unique_ptr<BlockPool> pool = MakeHostPool(SmallGqa(), 4);
  AgentEpoch epoch;
  AgentMetrics metrics("gpu-0", AgentPools{.main = pool.get()}, &epoch);
  metrics.RecordTransfer(absl::OkStatus(), 1 << 20, absl::Milliseconds(2));
  metrics.RecordTransfer(absl::UnavailableError("peer gone"), 0, absl::Milliseconds(1));

  const std::string text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr("kvcm_transfer_bytes_total 1048576"));
  EXPECT_THAT(text, HasSubstr("kvcm_transfer_seconds_count 1"));
  EXPECT_THAT(text, HasSubstr("kvcm_transfer_failures_total{reason=\"UNAVAILABLE\"} 1"));
  EXPECT_GT(metrics.pull_gbps(), 0);
}

}  // namespace
}  // namespace kvcm
