#include "common/token_table.h"

#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

const std::string kHashA = Sha256Hex("token-a-0123456789");
const std::string kHashB = Sha256Hex("token-b-0123456789");

void ExpectBadLine(const std::string& text, int line, absl::string_view what) {
  absl::StatusOr<TokenTable> t = TokenTable::Parse(text, "tokens");
  ASSERT_FALSE(t.ok()) << text;
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr(absl::StrCat("tokens:", line, ": ")));
  EXPECT_THAT(t.status().message(), HasSubstr(what));
}

TEST(TokenTableTest, Sha256MatchesTheStandardVector) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(TokenTableTest, FindsThePrincipalOfEachToken) {
  absl::StatusOr<TokenTable> t = TokenTable::Parse(
      absl::StrCat("# comment\n\n", kHashA, "  acme   roles=worker tenant=acme  # inline\n",
                   absl::AsciiStrToUpper(kHashB),
                   "\tedge roles=router,worker tenant=edge "
                   "tenants=acme,globex\n"),
      "tokens");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 2u);
  EXPECT_EQ(t->tenant_count(), 2u) << "acme and edge; a router's tenants= names none";
  std::shared_ptr<const Principal> a = t->Find("token-a-0123456789");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->name, "acme");
  EXPECT_TRUE(a->IsWorkerOf("acme"));
  EXPECT_FALSE(a->IsWorkerOf("globex"));
  EXPECT_TRUE(a->MayProbe("acme"));
  EXPECT_FALSE(a->MayProbe("globex"));
  EXPECT_FALSE(a->Has(Role::kAdmin));
  std::shared_ptr<const Principal> b = t->Find("token-b-0123456789");
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(b->MayProbe("globex"));
  EXPECT_FALSE(b->IsWorkerOf("globex")) << "tenants= grants probing, not work";
  EXPECT_TRUE(b->IsWorkerOf("edge"));
  EXPECT_EQ(t->Find("token-c-0123456789"), nullptr);
  EXPECT_EQ(RoleNames(b->roles), "worker,router");
}

TEST(TokenTableTest, RefusesBadLinesNamingThem) {
  ExpectBadLine("abc acme roles=worker tenant=acme\n", 1, "64 hex digits");
  ExpectBadLine(absl::StrCat("\n", kHashA, " acme\n"), 2, "expected");
  ExpectBadLine(absl::StrCat(kHashA, " acme roles=king tenant=acme\n"), 1, "unknown role");
  ExpectBadLine(absl::StrCat(kHashA, " acme roles=worker\n"), 1, "needs tenant=");
  ExpectBadLine(absl::StrCat(kHashA, " r roles=router\n"), 1, "needs tenants=");
  ExpectBadLine(absl::StrCat(kHashA, " g roles=agent\n"), 1, "needs agent=");
  ExpectBadLine(absl::StrCat(kHashA, " a roles=worker tenant=a tenants=*\n"), 1,
                "tenants= is for role router");
  ExpectBadLine(absl::StrCat(kHashA, " a roles=worker tenant=a/b\n"), 1, "bad tenant");
  ExpectBadLine(absl::StrCat(kHashA, " a roles=admin color=red\n"), 1, "unknown key");
  ExpectBadLine(absl::StrCat(kHashA, " a roles=admin\n", kHashA, " b roles=admin\n"), 2,
                "appears twice");
  ExpectBadLine(absl::StrCat(kHashA, " a roles=admin\n", kHashB, " a roles=admin\n"), 2,
                "appears twice");
  absl::StatusOr<TokenTable> empty = TokenTable::Parse("# nobody\n", "tokens");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TokenTable::Load("/nonexistent/tokens").status().code(), absl::StatusCode::kNotFound);
}

TEST(TokenTableTest, AnEnginePublishesAsItselfIntoItsTenantOnly) {
  absl::StatusOr<TokenTable> t = TokenTable::Parse(
      absl::StrCat(kHashA, " vllm-0 roles=engine engine=vllm-0 tenant=acme\n"), "tokens");
  ASSERT_TRUE(t.ok()) << t.status();
  std::shared_ptr<const Principal> e = t->Find("token-a-0123456789");
  ASSERT_NE(e, nullptr);
  EXPECT_TRUE(e->IsEngineOf("vllm-0", "acme"));
  EXPECT_FALSE(e->IsEngineOf("vllm-1", "acme"));
  EXPECT_FALSE(e->IsEngineOf("vllm-0", "globex"));
  EXPECT_FALSE(e->IsWorkerOf("acme")) << "tenant= of an engine grants no work";
  EXPECT_FALSE(e->IsAgent("vllm-0"));
  EXPECT_EQ(RoleNames(e->roles), "engine");
  ExpectBadLine(absl::StrCat(kHashA, " e roles=engine tenant=acme\n"), 1,
                "role engine needs engine= and tenant=");
  ExpectBadLine(absl::StrCat(kHashA, " e roles=engine engine=vllm-0\n"), 1,
                "role engine needs engine= and tenant=");
  ExpectBadLine(absl::StrCat(kHashA, " e roles=engine engine=a/b tenant=acme\n"), 1,
                "bad engine id");
  EXPECT_TRUE(OpenPrincipal()->IsEngineOf("anything", "any-tenant"));
}

TEST(TokenTableTest, BearerTokenParsesTheHeader) {
  EXPECT_EQ(*BearerToken("Bearer token-a-0123456789"), "token-a-0123456789");
  EXPECT_EQ(*BearerToken("bearer   token-a-0123456789 "), "token-a-0123456789");
  EXPECT_EQ(BearerToken("Basic dXNlcjpwYXNz").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(BearerToken("Bearer short").status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(TokenTableTest, TheOpenPrincipalMayDoEverything) {
  std::shared_ptr<const Principal> p = OpenPrincipal();
  EXPECT_TRUE(p->IsWorkerOf("any"));
  EXPECT_TRUE(p->IsAgent("gpu-7"));
  EXPECT_TRUE(p->Has(Role::kAdmin));
}

TEST(AgentIdentityTest, OneDnsLabelBeforeTheSuffixIsTheAgentName) {
  constexpr absl::string_view kSuffix = ".kvcm-agent.kvcm.svc";
  EXPECT_EQ(AgentNameFromDnsSan("kvcm-agent-x7k2p.kvcm-agent.kvcm.svc", kSuffix),
            "kvcm-agent-x7k2p");
  EXPECT_EQ(AgentNameFromDnsSan("a.kvcm-agent.kvcm.svc", kSuffix), "a");
  for (absl::string_view bad :
       {"kvcm-agent.kvcm.svc", ".kvcm-agent.kvcm.svc", "a.b.kvcm-agent.kvcm.svc",
        "-a.kvcm-agent.kvcm.svc", "a-.kvcm-agent.kvcm.svc", "A.kvcm-agent.kvcm.svc",
        "a_b.kvcm-agent.kvcm.svc", "a.kvcm-agent.kvcm.svc.evil", "spiffe://a.kvcm-agent.kvcm.svc",
        "a.kvcm-agent.other.svc"}) {
    EXPECT_EQ(AgentNameFromDnsSan(bad, kSuffix), std::nullopt) << bad;
  }
  EXPECT_EQ(AgentNameFromDnsSan(std::string(63, 'a') + std::string(kSuffix), kSuffix),
            std::string(63, 'a'));
  EXPECT_EQ(AgentNameFromDnsSan(std::string(64, 'a') + std::string(kSuffix), kSuffix),
            std::nullopt);
  EXPECT_EQ(AgentNameFromDnsSan("a.kvcm-agent.kvcm.svc", ""), std::nullopt);
}

TEST(AgentIdentityTest, ACertificateAgentActsAsItsNameAndItsPerGpuIdsOnly) {
  Principal p;
  p.roles = static_cast<uint8_t>(Role::kAgent);
  p.agent_id = "pod";
  EXPECT_TRUE(p.IsAgent("pod"));
  EXPECT_FALSE(p.IsAgent("pod-gpu0"));  // a token's agent: its one id
  p.agent_gpu_ids = true;
  for (absl::string_view ok : {"pod", "pod-gpu0", "pod-gpu7", "pod-gpu10", "pod-gpu255"}) {
    EXPECT_TRUE(p.IsAgent(ok)) << ok;
  }
  for (absl::string_view bad : {"pod-gpu256", "pod-gpu01", "pod-gpu", "pod-gpu-1", "pod-gpu1x",
                                "pod-gpu1000", "pod2-gpu0", "po", "pod-cpu0", "other-gpu0"}) {
    EXPECT_FALSE(p.IsAgent(bad)) << bad;
  }
  EXPECT_FALSE(IsGpuAgentIdOf("-gpu0", ""));
}

}  // namespace
}  // namespace kvcm
