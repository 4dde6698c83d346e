// The validating readers of proto/core_types.h, which the manager, the agent and the client
// share: the namespace alphabet and the model spec, with the field named in every error.
#include "proto/core_types.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// A small valid GQA spec: 2 layers, 8 query heads over 2 K/V heads of 64.
ModelSpec SmallGqa() {
  return ModelSpec{.attention = AttentionKind::kGqa,
                   .num_layers = 2,
                   .num_heads = 8,
                   .num_kv_heads = 2,
                   .head_dim = 64,
                   .dtype = KvDtype::kBf16,
                   .page_size_tokens = 16};
}

v1::Namespace Ns(std::string tenant, std::string model) {
  v1::Namespace ns;
  ns.set_tenant(std::move(tenant));
  ns.set_model(std::move(model));
  return ns;
}

TEST(CoreTypesTest, NamespaceFromProtoAcceptsTheManagersAlphabet) {
  const v1::Namespace good = Ns("acme.prod_1-a", "meta/llama-3.1_70B");
  absl::StatusOr<NamespaceId> ns = NamespaceFromProto(&good, "ns");
  ASSERT_TRUE(ns.ok()) << ns.status();
  EXPECT_EQ(*ns, (NamespaceId{"acme.prod_1-a", "meta/llama-3.1_70B"}));
  const v1::Namespace longest = Ns(std::string(128, 't'), std::string(128, 'm'));
  EXPECT_TRUE(NamespaceFromProto(&longest, "ns").ok());
}

TEST(CoreTypesTest, NamespaceFromProtoNamesTheBadMember) {
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
    absl::StatusOr<NamespaceId> ns = NamespaceFromProto(&c.ns, "namespace");
    EXPECT_EQ(ns.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(ns.status().message()),
                StartsWith(absl::StrCat(c.field, " must be 1..128")));
  }
}

TEST(CoreTypesTest, ModelSpecFromProtoRoundTripsAndNamesTheField) {
  v1::ModelSpec proto;
  ModelSpecToProto(SmallGqa(), &proto);
  absl::StatusOr<ModelSpec> spec = ModelSpecFromProto(&proto, "commit.spec");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(*spec, SmallGqa());

  proto.set_page_size_tokens(0);
  spec = ModelSpecFromProto(&proto, "commit.spec");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->page_size_tokens, kDefaultPageSizeTokens);

  proto.set_num_layers(0);
  spec = ModelSpecFromProto(&proto, "commit.spec");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), StartsWith("commit.spec.num_layers"));

  proto = v1::ModelSpec();  // unspecified attention
  spec = ModelSpecFromProto(&proto, "commit.spec");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("commit.spec.attention"));
}

TEST(CoreTypesTest, ModelSpecCarriesItsKvLayoutBothWays) {
  ModelSpec with_layout = SmallGqa();
  with_layout.kv_layout = "vllm-cpu:[kv_heads,block,2*head_dim]:bf16";
  v1::ModelSpec proto;
  ModelSpecToProto(with_layout, &proto);
  EXPECT_EQ(proto.kv_layout(), with_layout.kv_layout);
  absl::StatusOr<ModelSpec> spec = ModelSpecFromProto(&proto);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(*spec, with_layout);
  EXPECT_EQ(ModelSpecFromTrustedProto(proto), with_layout);

  proto.set_kv_layout(std::string(257, 'x'));
  spec = ModelSpecFromProto(&proto);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), StartsWith("spec.kv_layout"));
  proto.set_kv_layout("a\tb");
  spec = ModelSpecFromProto(&proto, "commit.spec");
  EXPECT_THAT(std::string(spec.status().message()), StartsWith("commit.spec.kv_layout"));
}

}  // namespace
}  // namespace kvcm
