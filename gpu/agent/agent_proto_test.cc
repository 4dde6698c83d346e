#include "gpu/agent/agent_proto.h"

#include <string>

#include "gmock/gmock.h"
#include "gpu/agent/agent_test_util.h"
#include "gtest/gtest.h"
#include "proto/core_types.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

v1::Namespace Ns(std::string tenant, std::string model) {
  v1::Namespace ns;
  ns.set_tenant(std::move(tenant));
  ns.set_model(std::move(model));
  return ns;
}

TEST(AgentProtoTest, ParseNamespaceAcceptsTheManagersAlphabet) {
  absl::StatusOr<NamespaceId> ns = ParseNamespace(Ns("acme.prod_1-a", "meta/llama-3.1_70B"), "ns");
  ASSERT_TRUE(ns.ok()) << ns.status();
  EXPECT_EQ(*ns, (NamespaceId{"acme.prod_1-a", "meta/llama-3.1_70B"}));
  EXPECT_TRUE(ParseNamespace(Ns(std::string(128, 't'), std::string(128, 'm')), "ns").ok());
}

TEST(AgentProtoTest, ParseNamespaceNamesTheBadMember) {
  struct Case {
    v1::Namespace ns;
    const char* field;
  };
  const Case cases[] = {
      {Ns("", "m"), "namespace.tenant"},
      {Ns("a/b", "m"), "namespace.tenant"},  // '/' only in models
      {Ns(std::string(129, 't'), "m"), "namespace.tenant"},
      {Ns("t", ""), "namespace.model"},
      {Ns("t", "m:1"), "namespace.model"},
      {Ns("t", std::string(129, 'm')), "namespace.model"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<NamespaceId> ns = ParseNamespace(c.ns, "namespace");
    EXPECT_EQ(ns.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(ns.status().message()),
                StartsWith(absl::StrCat(c.field, " must be 1..128")));
  }
}

TEST(AgentProtoTest, ParseModelSpecRoundTripsAndNamesTheField) {
  v1::ModelSpec proto;
  ModelSpecToProto(SmallGqa(), &proto);
  absl::StatusOr<ModelSpec> spec = ParseModelSpec(proto, "commit.spec");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(*spec, SmallGqa());

  proto.set_page_size_tokens(0);
  spec = ParseModelSpec(proto, "commit.spec");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->page_size_tokens, kDefaultPageSizeTokens);

  proto.set_num_layers(0);
  spec = ParseModelSpec(proto, "commit.spec");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), StartsWith("commit.spec.num_layers"));

  proto = v1::ModelSpec();  // unspecified attention
  spec = ParseModelSpec(proto, "commit.spec");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("commit.spec.attention"));
}

}  // namespace
}  // namespace kvcm
