#include "common/transports.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

static_assert(kDefaultTransport == "tcp", "TCP runs on any host, so it stays the default");
static_assert(DefaultLinkGbps("tcp") == 25 && DefaultLinkGbps("nccl") == 400);
static_assert(DefaultLinkGbps("rdma") == 0);

TEST(TransportsTest, EveryRowIsNamedOnceAndCostsALink) {
  for (const TransportDescription& t : kTransportDescriptions) {
    EXPECT_EQ(FindTransportDescription(t.name), &t) << t.name;
    EXPECT_GE(t.default_link_gbps, 1u) << t.name;
    EXPECT_FALSE(t.summary.empty()) << t.name;
  }
  EXPECT_EQ(TransportNames(), "tcp, nccl");
  EXPECT_THAT(TransportHelp(), HasSubstr("nccl (NCCL links between GPUs"));
}

TEST(TransportsTest, AnUnknownNameIsRefusedNamingTheFieldAndTheKnownNames) {
  EXPECT_EQ((*LookupTransport("nccl"))->name, "nccl");
  absl::StatusOr<const TransportDescription*> bad = LookupTransport("NCCL", "--transport");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "--transport must be one of tcp, nccl; got \"NCCL\"");
}

TEST(TransportsTest, OnlyNcclBootstrapsThroughTheManager) {
  EXPECT_TRUE(UsesBootstrapRelay("nccl"));
  EXPECT_FALSE(UsesBootstrapRelay("tcp"));
  EXPECT_FALSE(UsesBootstrapRelay(""));
  EXPECT_FALSE(UsesBootstrapRelay("udp"));
}

}  // namespace
}  // namespace kvcm
