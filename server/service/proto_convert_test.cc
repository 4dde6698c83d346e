#include "server/service/proto_convert.h"

#include <memory>
#include <string>
#include <vector>

#include "common/page_hash.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/clock.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kPageSize = 4;

// Expects `status` to have `code` and a message containing `field`.
template <typename T>
void ExpectError(const absl::StatusOr<T>& result, absl::StatusCode code, const std::string& field) {
  ASSERT_FALSE(result.ok()) << "expected " << absl::StatusCodeToString(code) << " naming " << field;
  EXPECT_EQ(result.status().code(), code) << result.status();
  EXPECT_THAT(std::string(result.status().message()), HasSubstr(field));
}

class ProtoConvertTest : public ::testing::Test {
 protected:
  ProtoConvertTest() {
    CacheIndexOptions options;
    options.hash_secret = HashKey{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
    options.clock = &clock_;
    index_ = *CacheIndex::Create(options);
    spec_.attention = AttentionKind::kMla;
    spec_.num_layers = 2;
    spec_.num_heads = 4;
    spec_.kv_lora_rank = 128;
    spec_.rope_dim = 64;
    spec_.page_size_tokens = kPageSize;
    absl::StatusOr<RegisterModelResult> r = index_->RegisterModel(ns_, spec_);
    EXPECT_TRUE(r.ok()) << r.status();
    key_ = r->hash_key;
    limits_.max_tokens_per_request = 64;
    limits_.max_pages_per_request = 8;
    limits_.max_lease_ttl_ms = 1000;
  }

  static std::vector<int32_t> Tokens(int n) {
    std::vector<int32_t> t(n);
    for (int i = 0; i < n; ++i) t[i] = 1000 + i;
    return t;
  }

  v1::MatchRequest MatchTokens(int n) const {
    v1::MatchRequest req;
    NamespaceToProto(ns_, req.mutable_namespace_());
    for (int32_t t : Tokens(n)) req.mutable_prompt()->mutable_tokens()->add_ids(t);
    return req;
  }

  // A Match carrying `n` tokens' page hashes and a correct scheme.
  v1::MatchRequest MatchHashes(int n) const {
    v1::MatchRequest req;
    NamespaceToProto(ns_, req.mutable_namespace_());
    std::vector<int32_t> tokens = Tokens(n);
    req.mutable_prompt()->set_page_hashes(EncodePageHashes(HashPages(key_, tokens, kPageSize)));
    v1::HashScheme* scheme = req.mutable_prompt()->mutable_scheme();
    scheme->set_version(kPageHashVersion);
    scheme->set_page_size_tokens(kPageSize);
    scheme->set_key_fingerprint(KeyFingerprint(key_));
    return req;
  }

  v1::InsertRequest InsertTokens(int n, int blocks) const {
    v1::InsertRequest req;
    NamespaceToProto(ns_, req.mutable_namespace_());
    for (int32_t t : Tokens(n)) req.mutable_prompt()->mutable_tokens()->add_ids(t);
    req.mutable_pool()->set_agent_id("gpu-0");
    req.mutable_pool()->set_tier(v1::TIER_GPU);
    for (int i = 0; i < blocks; ++i) req.add_block_ids(i);
    return req;
  }

  FakeClock clock_;
  std::unique_ptr<CacheIndex> index_;
  NamespaceId ns_{"acme", "deepseek/v3"};
  ModelSpec spec_;
  HashKey key_;
  RequestLimits limits_;
};

TEST_F(ProtoConvertTest, ValidTokenAndHashPromptsResolveToTheSamePages) {
  absl::StatusOr<MatchCall> by_tokens = MatchFromProto(*index_, MatchTokens(10), limits_);
  ASSERT_TRUE(by_tokens.ok()) << by_tokens.status();
  absl::StatusOr<MatchCall> by_hashes = MatchFromProto(*index_, MatchHashes(10), limits_);
  ASSERT_TRUE(by_hashes.ok()) << by_hashes.status();
  EXPECT_EQ(by_tokens->prompt.pages.size(), 2u);  // the partial third page is ignored
  EXPECT_EQ(by_tokens->prompt.pages, by_hashes->prompt.pages);
  EXPECT_EQ(by_tokens->prompt.page_size_tokens, kPageSize);
  EXPECT_EQ(by_tokens->ns, ns_);
}

TEST_F(ProtoConvertTest, MatchCopiesOptions) {
  v1::MatchRequest req = MatchTokens(8);
  req.set_requester_agent_id("host-1:gpu.0");
  req.set_pin(true);
  req.set_lease_ttl_ms(750);
  absl::StatusOr<MatchCall> call = MatchFromProto(*index_, req, limits_);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->options.requester_agent_id, "host-1:gpu.0");
  EXPECT_TRUE(call->options.pin);
  EXPECT_FALSE(call->options.probe);
  EXPECT_EQ(call->options.lease_ttl, absl::Milliseconds(750));
}

TEST_F(ProtoConvertTest, MissingNamespace) {
  v1::MatchRequest req = MatchTokens(8);
  req.clear_namespace_();
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "namespace is required");
}

TEST_F(ProtoConvertTest, InvalidTenantAndModelNames) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "m"}, {"bad tenant", "m"}, {std::string(129, 'a'), "m"}, {"a/b", "m"}};
  for (const auto& [tenant, model] : bad) {
    v1::MatchRequest req = MatchTokens(8);
    req.mutable_namespace_()->set_tenant(tenant);
    req.mutable_namespace_()->set_model(model);
    ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
                "namespace.tenant must be 1..128 bytes of [A-Za-z0-9._-]");
  }
  for (const std::string& model : {std::string(), std::string("a b"), std::string(129, 'm')}) {
    v1::MatchRequest req = MatchTokens(8);
    req.mutable_namespace_()->set_model(model);
    ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
                "namespace.model must be 1..128 bytes of [A-Za-z0-9._/-]");
  }
  v1::Namespace ok;
  ok.set_tenant(std::string(128, 't'));
  ok.set_model("org/Model-7B_v1.5");
  EXPECT_TRUE(NamespaceFromProto(&ok, "namespace").ok());
}

TEST_F(ProtoConvertTest, UnknownNamespaceIsNotFound) {
  v1::MatchRequest req = MatchTokens(8);
  req.mutable_namespace_()->set_tenant("other");
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kNotFound, "other");
}

TEST_F(ProtoConvertTest, EmptyPrompts) {
  v1::MatchRequest req = MatchTokens(8);
  req.clear_prompt();
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "prompt is required");
  req.mutable_prompt();  // present, no content
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "prompt is empty: set prompt.tokens or prompt.page_hashes");
  req.mutable_prompt()->mutable_tokens();
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "prompt.tokens is empty");
  req.mutable_prompt()->set_page_hashes("");
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "prompt.page_hashes is empty");
}

TEST_F(ProtoConvertTest, MalformedHashes) {
  v1::MatchRequest req = MatchHashes(8);
  req.mutable_prompt()->set_page_hashes(std::string(17, 'x'));
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "prompt.page_hashes length 17 is not a multiple of 16");
}

TEST_F(ProtoConvertTest, HashesWithoutScheme) {
  v1::MatchRequest req = MatchHashes(8);
  req.mutable_prompt()->clear_scheme();
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "prompt.scheme is required");
}

TEST_F(ProtoConvertTest, SchemeMismatches) {
  v1::MatchRequest req = MatchHashes(8);
  req.mutable_prompt()->mutable_scheme()->set_page_size_tokens(kPageSize * 2);
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "prompt.scheme.page_size_tokens 8 does not match the namespace's page_size_tokens 4");

  req = MatchHashes(8);
  req.mutable_prompt()->mutable_scheme()->set_version(kPageHashVersion + 1);
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kFailedPrecondition,
              "prompt.scheme.version");

  req = MatchHashes(8);
  req.mutable_prompt()->mutable_scheme()->set_key_fingerprint(KeyFingerprint(key_) ^ 1);
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kFailedPrecondition,
              "prompt.scheme.key_fingerprint");
}

TEST_F(ProtoConvertTest, OversizePrompts) {
  ExpectError(MatchFromProto(*index_, MatchTokens(65), limits_), absl::StatusCode::kInvalidArgument,
              "prompt.tokens has 65 ids, more than max_tokens_per_request (64)");
  EXPECT_TRUE(MatchFromProto(*index_, MatchTokens(32), limits_).ok());  // 8 pages: the limit

  ExpectError(MatchFromProto(*index_, MatchTokens(36), limits_), absl::StatusCode::kInvalidArgument,
              "prompt.tokens spans 9 pages of 4 tokens, more than max_pages_per_request (8)");
  ExpectError(MatchFromProto(*index_, MatchHashes(36), limits_), absl::StatusCode::kInvalidArgument,
              "prompt.page_hashes has 9 pages, more than max_pages_per_request (8)");
}

TEST_F(ProtoConvertTest, LeaseProbeAndRequester) {
  v1::MatchRequest req = MatchTokens(8);
  req.set_pin(true);
  req.set_lease_ttl_ms(1001);
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "lease_ttl_ms 1001 exceeds max_lease_ttl_ms (1000)");

  req = MatchTokens(8);
  req.set_pin(true);
  req.set_probe(true);
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "probe and pin are mutually exclusive");

  req = MatchTokens(8);
  req.set_requester_agent_id("gpu 0");
  ExpectError(MatchFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "requester_agent_id must be 1..128 bytes of [A-Za-z0-9._:-]");
}

TEST_F(ProtoConvertTest, InsertValid) {
  absl::StatusOr<InsertCall> call = InsertFromProto(*index_, InsertTokens(9, 2), limits_);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->pool, (PoolKey{"gpu-0", Tier::kGpu}));
  EXPECT_EQ(call->block_ids, (std::vector<BlockId>{0, 1}));
  EXPECT_EQ(call->prompt.pages.size(), 2u);
}

TEST_F(ProtoConvertTest, InsertBlockCountMustMatchPages) {
  ExpectError(InsertFromProto(*index_, InsertTokens(16, 3), limits_),
              absl::StatusCode::kInvalidArgument,
              "block_ids has 3 entries, expected 4 (one per whole page)");
  ExpectError(InsertFromProto(*index_, InsertTokens(3, 0), limits_),
              absl::StatusCode::kInvalidArgument, "prompt has no whole page");
}

TEST_F(ProtoConvertTest, InsertBlockIdsAreDistinctAndNeverPending) {
  v1::InsertRequest req = InsertTokens(12, 3);
  req.set_block_ids(2, 0);
  ExpectError(InsertFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "block_ids[2] repeats block_ids[0] (block 0): a block holds one page");
  req = InsertTokens(12, 3);
  req.set_block_ids(1, kPendingBlock);
  ExpectError(InsertFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "block_ids[1] is 0xFFFFFFFF, the value reserved for a pending block");
  req = InsertTokens(12, 3);
  req.set_agent_epoch(42);
  req.set_use_reservation(true);
  absl::StatusOr<InsertCall> call = InsertFromProto(*index_, req, limits_);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->agent_epoch, 42u);
  EXPECT_TRUE(call->use_reservation);
}

TEST_F(ProtoConvertTest, InsertPoolRules) {
  v1::InsertRequest req = InsertTokens(8, 2);
  req.clear_pool();
  ExpectError(InsertFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "pool is required");

  req = InsertTokens(8, 2);
  req.mutable_pool()->set_tier(v1::TIER_UNSPECIFIED);
  ExpectError(InsertFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "pool.tier must be TIER_GPU, TIER_HOST or TIER_DISK, got TIER_UNSPECIFIED");

  req = InsertTokens(8, 2);
  req.mutable_pool()->set_tier(static_cast<v1::Tier>(99));
  ExpectError(InsertFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
              "pool.tier must be TIER_GPU, TIER_HOST or TIER_DISK, got unknown value (99)");

  for (const std::string& agent : {std::string(), std::string("a/b"), std::string(129, 'a')}) {
    req = InsertTokens(8, 2);
    req.mutable_pool()->set_agent_id(agent);
    ExpectError(InsertFromProto(*index_, req, limits_), absl::StatusCode::kInvalidArgument,
                "pool.agent_id must be 1..128 bytes of [A-Za-z0-9._:-]");
  }

  req = InsertTokens(8, 2);
  req.mutable_pool()->set_tier(v1::TIER_HOST);
  req.mutable_pool()->set_agent_id("node-3:gpu.1");
  absl::StatusOr<InsertCall> call = InsertFromProto(*index_, req, limits_);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->pool, (PoolKey{"node-3:gpu.1", Tier::kHost}));
}

TEST_F(ProtoConvertTest, ReleaseAndRenew) {
  v1::ReleaseRequest release;
  NamespaceToProto(ns_, release.mutable_namespace_());
  ExpectError(ReleaseFromProto(release), absl::StatusCode::kInvalidArgument, "pin_id is required");
  release.set_pin_id(7);
  absl::StatusOr<PinCall> call = ReleaseFromProto(release);
  ASSERT_TRUE(call.ok());
  EXPECT_EQ(call->pin_id, 7u);

  v1::RenewLeaseRequest renew;
  NamespaceToProto(ns_, renew.mutable_namespace_());
  renew.set_pin_id(7);
  renew.set_lease_ttl_ms(5000);
  ExpectError(RenewLeaseFromProto(renew, limits_), absl::StatusCode::kInvalidArgument,
              "lease_ttl_ms 5000 exceeds max_lease_ttl_ms (1000)");
  renew.set_lease_ttl_ms(0);
  call = RenewLeaseFromProto(renew, limits_);
  ASSERT_TRUE(call.ok());
  EXPECT_EQ(call->lease_ttl, absl::ZeroDuration());
}

TEST_F(ProtoConvertTest, EvictRequests) {
  v1::EvictRequest req;
  req.set_bytes(10);
  ExpectError(EvictFromProto(req), absl::StatusCode::kInvalidArgument,
              "target is required: set pool or namespace");

  req.mutable_pool()->set_agent_id("gpu-0");
  req.mutable_pool()->set_tier(v1::TIER_GPU);
  req.set_bytes(0);
  ExpectError(EvictFromProto(req), absl::StatusCode::kInvalidArgument, "bytes must be > 0");

  req.set_bytes(10);
  absl::StatusOr<EvictCall> call = EvictFromProto(req);
  ASSERT_TRUE(call.ok());
  EXPECT_EQ(std::get<PoolKey>(call->target), (PoolKey{"gpu-0", Tier::kGpu}));

  req.mutable_pool()->set_tier(v1::TIER_UNSPECIFIED);
  ExpectError(EvictFromProto(req), absl::StatusCode::kInvalidArgument, "pool.tier");

  NamespaceToProto(ns_, req.mutable_namespace_());  // replaces the pool (oneof)
  call = EvictFromProto(req);
  ASSERT_TRUE(call.ok());
  EXPECT_EQ(std::get<NamespaceId>(call->target), ns_);
  req.mutable_namespace_()->set_tenant("");
  ExpectError(EvictFromProto(req), absl::StatusCode::kInvalidArgument, "namespace.tenant");
}

TEST_F(ProtoConvertTest, RegisterModelSpecs) {
  v1::RegisterModelRequest req;
  NamespaceToProto(ns_, req.mutable_namespace_());
  ExpectError(RegisterModelFromProto(req), absl::StatusCode::kInvalidArgument, "spec is required");

  v1::ModelSpec* spec = req.mutable_spec();
  spec->set_attention(v1::ATTENTION_KIND_GQA);
  spec->set_num_layers(80);
  spec->set_num_heads(64);
  spec->set_num_kv_heads(8);
  spec->set_head_dim(128);
  spec->set_dtype(v1::KV_DTYPE_BF16);
  absl::StatusOr<RegisterModelCall> call = RegisterModelFromProto(req);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->spec.page_size_tokens, kDefaultPageSizeTokens);  // 0 means the default
  EXPECT_EQ(call->spec.BytesPerToken(), 80u * 2 * 8 * 128 * 2);    // Llama-3-70B
  v1::ModelSpec round_trip;
  ModelSpecToProto(call->spec, &round_trip);
  absl::StatusOr<ModelSpec> back = ModelSpecFromProto(&round_trip);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, call->spec);

  spec->set_attention(v1::ATTENTION_KIND_UNSPECIFIED);
  ExpectError(RegisterModelFromProto(req), absl::StatusCode::kInvalidArgument, "spec.attention");
  spec->set_attention(static_cast<v1::AttentionKind>(42));
  ExpectError(RegisterModelFromProto(req), absl::StatusCode::kInvalidArgument, "spec.attention");
  spec->set_attention(v1::ATTENTION_KIND_GQA);
  spec->set_dtype(v1::KV_DTYPE_UNSPECIFIED);
  ExpectError(RegisterModelFromProto(req), absl::StatusCode::kInvalidArgument, "spec.dtype");
  spec->set_dtype(static_cast<v1::KvDtype>(9));
  ExpectError(RegisterModelFromProto(req), absl::StatusCode::kInvalidArgument, "spec.dtype");
  spec->set_dtype(v1::KV_DTYPE_FP16);
  spec->set_num_layers(0);
  ExpectError(RegisterModelFromProto(req), absl::StatusCode::kInvalidArgument, "spec.num_layers");
}

TEST_F(ProtoConvertTest, RegisterModelMaxPageAge) {
  v1::RegisterModelRequest req;
  NamespaceToProto(ns_, req.mutable_namespace_());
  ModelSpecToProto(spec_, req.mutable_spec());
  absl::StatusOr<RegisterModelCall> call = RegisterModelFromProto(req);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->max_page_age, absl::ZeroDuration());  // the manager's default
  req.set_max_page_age_s(kMaxPageAgeS);
  call = RegisterModelFromProto(req);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->max_page_age, absl::Seconds(kMaxPageAgeS));
  req.set_max_page_age_s(kMaxPageAgeS + 1);
  ExpectError(RegisterModelFromProto(req), absl::StatusCode::kInvalidArgument, "max_page_age_s");

  // The response and Stats say what is in force.
  absl::StatusOr<RegisterModelResult> r =
      index_->RegisterModel(ns_, spec_, CacheIndex::NamespaceSource::kClient, absl::Seconds(600));
  ASSERT_TRUE(r.ok()) << r.status();
  v1::RegisterModelResponse resp;
  RegisterModelResultToProto(*r, &resp);
  EXPECT_EQ(resp.max_page_age_s(), 600u);
  v1::StatsResponse stats;
  StatsToProto(index_->Stats(), RequestLimits{}, &stats);
  ASSERT_EQ(stats.namespaces_size(), 1);
  EXPECT_EQ(stats.namespaces(0).max_page_age_s(), 600u);
  EXPECT_EQ(stats.namespaces(0).expired_pages(), 0u);
  EXPECT_EQ(stats.counters().expired_pages(), 0u);
}

TEST_F(ProtoConvertTest, RegisterModelResponseCarriesTheScheme) {
  absl::StatusOr<RegisterModelResult> r = index_->GetNamespace(ns_);
  ASSERT_TRUE(r.ok());
  v1::RegisterModelResponse resp;
  RegisterModelResultToProto(*r, &resp);
  EXPECT_EQ(resp.hash_key(), key_.ToBytes());
  EXPECT_EQ(resp.scheme().version(), kPageHashVersion);
  EXPECT_EQ(resp.scheme().page_size_tokens(), kPageSize);
  EXPECT_EQ(resp.scheme().key_fingerprint(), KeyFingerprint(key_));
  EXPECT_EQ(resp.bytes_per_token(), spec_.BytesPerToken());
  EXPECT_EQ(resp.bytes_per_page(), spec_.BytesPerPage());
}

TEST_F(ProtoConvertTest, MatchResultToProto) {
  MatchResult r;
  r.matched_pages = 4;
  r.prompt_pages = 5;
  r.local_pages = 1;
  const PoolKey host{"a", Tier::kHost};
  const PoolKey gpu{"b", Tier::kGpu};
  // Pages [0, 3) in two pools, the second listed first (as for a requester on "b"), then
  // page 3 in the host pool only.
  r.segments = {{.first_page = 0, .num_pages = 3, .first_replica = 0, .num_replicas = 2},
                {.first_page = 3, .num_pages = 1, .first_replica = 2, .num_replicas = 1}};
  r.replicas = {{&gpu, 3}, {&host, 0}, {&host, 6}};
  r.block_ids = {7, 8, 9, 40, 41, 42, 10};
  r.pin_id = 12;
  r.lease_expiry = absl::FromUnixMillis(1'700'000'123'456);
  v1::MatchResponse resp;
  MatchResultToProto(r, kPageSize, &resp);
  EXPECT_EQ(resp.matched_pages(), 4u);
  EXPECT_EQ(resp.matched_tokens(), 16u);
  EXPECT_EQ(resp.prompt_pages(), 5u);
  EXPECT_EQ(resp.local_pages(), 1u);
  ASSERT_EQ(resp.segments_size(), 2);
  ASSERT_EQ(resp.segments(0).replicas_size(), 2);
  EXPECT_EQ(resp.segments(0).replicas(0).pool().agent_id(), "b");
  EXPECT_THAT(resp.segments(0).replicas(0).block_ids(), ::testing::ElementsAre(40, 41, 42));
  EXPECT_EQ(resp.segments(0).replicas(1).pool().tier(), v1::TIER_HOST);
  EXPECT_THAT(resp.segments(0).replicas(1).block_ids(), ::testing::ElementsAre(7, 8, 9));
  EXPECT_EQ(resp.segments(1).first_page(), 3u);
  ASSERT_EQ(resp.segments(1).replicas_size(), 1);
  EXPECT_THAT(resp.segments(1).replicas(0).block_ids(), ::testing::ElementsAre(10));
  EXPECT_EQ(resp.pin_id(), 12u);
  EXPECT_EQ(resp.lease_expiry_unix_ms(), 1'700'000'123'456);

  MatchResult unpinned;  // lease_expiry is InfinitePast: reported as 0
  MatchResultToProto(unpinned, kPageSize, &resp);
  EXPECT_EQ(resp.lease_expiry_unix_ms(), 0);
}

TEST_F(ProtoConvertTest, ReserveRequests) {
  v1::ReserveRequest req;
  req.set_bytes(10);
  ExpectError(ReserveFromProto(req), absl::StatusCode::kInvalidArgument, "pool");
  req.mutable_pool()->set_agent_id("gpu-0");
  req.mutable_pool()->set_tier(v1::TIER_GPU);
  absl::StatusOr<ReserveCall> call = ReserveFromProto(req);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->pool, (PoolKey{"gpu-0", Tier::kGpu}));
  EXPECT_EQ(call->bytes, 10u);
  EXPECT_EQ(call->tenant, "");
  req.set_tenant("acme");
  call = ReserveFromProto(req);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->tenant, "acme");
  req.set_tenant("ac me");
  ExpectError(ReserveFromProto(req), absl::StatusCode::kInvalidArgument, "tenant");
  req.set_tenant("acme");
  req.set_bytes(0);
  ExpectError(ReserveFromProto(req), absl::StatusCode::kInvalidArgument, "bytes must be > 0");
}

TEST_F(ProtoConvertTest, StatsToProto) {
  IndexStats stats;
  stats.pools.push_back({PoolKey{"gpu-0", Tier::kGpu}, 1000, 600, 100, 3});
  stats.pools.back().tenant_share_bytes = 500;
  stats.namespaces.push_back({ns_, spec_, 4, 6, 2});
  stats.counters.match_requests = 5;
  stats.counters.requested_tokens = 40;
  stats.counters.matched_tokens = 24;
  stats.counters.eviction_regret_pages = 2;
  stats.active_pins = 1;
  stats.policy = "lru";
  stats.tenants.push_back({.tenant = "acme",
                           .namespaces = 1,
                           .stored_bytes = 600,
                           .pinned_bytes = 100,
                           .reserved_bytes = 50,
                           .pins = 1,
                           .engine_pages = 12});
  stats.default_tenant_pool_share_pct = 50;
  stats.max_engine_pages_per_engine = 20;
  stats.max_engine_pages_per_tenant = 30;
  stats.tenant_max_bytes = 4000;
  stats.tenant_max_pinned_bytes = 1000;
  RequestLimits limits{100, 10, 2000, 500};
  v1::StatsResponse resp;
  StatsToProto(stats, limits, &resp);
  ASSERT_EQ(resp.pools_size(), 1);
  EXPECT_EQ(resp.pools(0).pool().agent_id(), "gpu-0");
  EXPECT_EQ(resp.pools(0).used_bytes(), 600u);
  EXPECT_EQ(resp.pools(0).pinned_bytes(), 100u);
  ASSERT_EQ(resp.namespaces_size(), 1);
  EXPECT_EQ(resp.namespaces(0).namespace_().model(), "deepseek/v3");
  EXPECT_EQ(resp.namespaces(0).bytes_per_page(), spec_.BytesPerPage());
  EXPECT_EQ(resp.namespaces(0).page_locations(), 6u);
  EXPECT_EQ(resp.counters().matched_tokens(), 24u);
  EXPECT_EQ(resp.counters().eviction_regret_pages(), 2u);
  EXPECT_EQ(resp.active_pins(), 1u);
  EXPECT_EQ(resp.policy(), "lru");
  EXPECT_EQ(resp.limits().max_tokens_per_request(), 100u);
  EXPECT_EQ(resp.limits().max_pages_per_request(), 10u);
  EXPECT_EQ(resp.limits().max_lease_ttl_ms(), 2000u);
  EXPECT_EQ(resp.limits().default_lease_ttl_ms(), 500u);
  EXPECT_EQ(resp.limits().default_tenant_pool_share_pct(), 50u);
  EXPECT_EQ(resp.limits().max_engine_pages_per_engine(), 20u);
  EXPECT_EQ(resp.limits().max_engine_pages_per_tenant(), 30u);
  EXPECT_EQ(resp.pools(0).tenant_share_bytes(), 500u);
  EXPECT_EQ(resp.tenants(0).engine_pages(), 12u);
  EXPECT_EQ(resp.tenants(0).max_engine_pages(), 30u);
  ASSERT_EQ(resp.tenants_size(), 1);
  EXPECT_EQ(resp.tenants(0).tenant(), "acme");
  EXPECT_EQ(resp.tenants(0).namespaces(), 1u);
  EXPECT_EQ(resp.tenants(0).stored_bytes(), 600u);
  EXPECT_EQ(resp.tenants(0).pinned_bytes(), 100u);
  EXPECT_EQ(resp.tenants(0).reserved_bytes(), 50u);
  EXPECT_EQ(resp.tenants(0).pins(), 1u);
  EXPECT_EQ(resp.tenants(0).max_bytes(), 4000u);
  EXPECT_EQ(resp.tenants(0).max_pinned_bytes(), 1000u);
  EXPECT_FALSE(resp.has_selection()) << "only policy \"select\" reports a selection";
}

TEST_F(ProtoConvertTest, StatsToProtoCarriesSelectsChoice) {
  IndexStats stats;
  stats.policy = "select";
  stats.selection = SelectionStats{.active = "cost",
                                   .candidates = {{"lru", 0.25}, {"cost", 0.5}},
                                   .switches = 2,
                                   .sampled_lookup_pages = 300,
                                   .sampled_store_pages = 400,
                                   .shadow_pages = 120,
                                   .pools = 3,
                                   .min_sample_rate = 0.0625};
  v1::StatsResponse resp;
  StatsToProto(stats, RequestLimits{}, &resp);
  ASSERT_TRUE(resp.has_selection());
  const v1::PolicySelection& sel = resp.selection();
  EXPECT_EQ(sel.active(), "cost");
  ASSERT_EQ(sel.candidates_size(), 2);
  EXPECT_EQ(sel.candidates(0).name(), "lru");
  EXPECT_EQ(sel.candidates(0).shadow_hit_rate(), 0.25);
  EXPECT_EQ(sel.candidates(1).name(), "cost");
  EXPECT_EQ(sel.candidates(1).shadow_hit_rate(), 0.5);
  EXPECT_EQ(sel.switches(), 2u);
  EXPECT_EQ(sel.sampled_lookup_pages(), 300u);
  EXPECT_EQ(sel.sampled_store_pages(), 400u);
  EXPECT_EQ(sel.shadow_pages(), 120u);
  EXPECT_EQ(sel.pools(), 3u);
  EXPECT_EQ(sel.min_sample_rate(), 0.0625);
}

TEST_F(ProtoConvertTest, WatchFilterAndEvents) {
  v1::WatchEventsRequest req;
  absl::StatusOr<std::optional<NamespaceId>> filter = WatchFilterFromProto(req);
  ASSERT_TRUE(filter.ok());
  EXPECT_FALSE(filter->has_value());
  NamespaceToProto(ns_, req.mutable_namespace_());
  filter = WatchFilterFromProto(req);
  ASSERT_TRUE(filter.ok());
  EXPECT_EQ(**filter, ns_);
  req.mutable_namespace_()->set_model("");
  ExpectError(WatchFilterFromProto(req), absl::StatusCode::kInvalidArgument, "namespace.model");

  CacheEvent event{CacheEvent::Kind::kRemoved,
                   ns_,
                   PoolKey{"gpu-1", Tier::kDisk},
                   {PageHash{1, 2}, PageHash{3, 4}}};
  v1::CacheEvent proto;
  CacheEventToProto(event, 77, &proto);
  EXPECT_EQ(proto.kind(), v1::CacheEvent::KIND_REMOVED);
  EXPECT_EQ(proto.sequence(), 77u);
  EXPECT_EQ(proto.pool().tier(), v1::TIER_DISK);
  EXPECT_EQ(proto.namespace_().tenant(), "acme");
  EXPECT_EQ(DecodePageHashes(proto.page_hashes()), event.pages);
  EXPECT_EQ(proto.reason(), v1::CacheEvent::REASON_UNSPECIFIED);
  event.reason = CacheEvent::Reason::kExpired;
  CacheEventToProto(event, 78, &proto);
  EXPECT_EQ(proto.reason(), v1::CacheEvent::REASON_EXPIRED);
  event.reason = CacheEvent::Reason::kEvicted;
  CacheEventToProto(event, 79, &proto);
  EXPECT_EQ(proto.reason(), v1::CacheEvent::REASON_EVICTED);
}

TEST_F(ProtoConvertTest, AgentCommandsToProto) {
  v1::AgentCommand out;
  AgentCommandToProto(
      AgentCommand{.sequence = 3,
                   .body = FreeBlocksCommand{.tier = Tier::kHost, .block_ids = {4, 5}},
                   .acked_through = 2},
      99, &out);
  EXPECT_EQ(out.sequence(), 3u);
  EXPECT_EQ(out.acked_through(), 2u);
  EXPECT_EQ(out.manager_incarnation(), 99u);
  ASSERT_TRUE(out.has_free());
  EXPECT_EQ(out.free().tier(), v1::TIER_HOST);
  EXPECT_THAT(out.free().block_ids(), ::testing::ElementsAre(4, 5));

  AgentCommandToProto(
      AgentCommand{.sequence = 4, .body = DemoteBlocksCommand{.source_block_ids = {7}}}, 99, &out);
  EXPECT_EQ(out.sequence(), 4u);
  EXPECT_EQ(out.acked_through(), 0u);
  ASSERT_TRUE(out.has_demote());
  EXPECT_THAT(out.demote().source_block_ids(), ::testing::ElementsAre(7));

  const std::vector<PageHash> pages = {{1, 2}, {3, 4}};
  AgentCommandToProto(AgentCommand{.sequence = 5,
                                   .body = CommitBlocksCommand{.tier = Tier::kGpu,
                                                               .ns = ns_,
                                                               .spec = spec_,
                                                               .block_ids = {8, 9},
                                                               .pages = pages,
                                                               .committed_unix_ms = 1234,
                                                               .max_page_age_s = 60}},
                      99, &out);
  ASSERT_TRUE(out.has_commit());
  EXPECT_EQ(out.commit().tier(), v1::TIER_GPU);
  EXPECT_EQ(out.commit().namespace_().tenant(), ns_.tenant);
  EXPECT_EQ(ModelSpecFromProto(&out.commit().spec()).value(), spec_);
  EXPECT_THAT(out.commit().block_ids(), ::testing::ElementsAre(8, 9));
  EXPECT_EQ(DecodePageHashes(out.commit().page_hashes()), pages);
  EXPECT_TRUE(out.commit().first_parent_hash().empty());
  EXPECT_EQ(out.commit().committed_unix_ms(), 1234);
  EXPECT_EQ(out.commit().max_page_age_s(), 60u);

  AgentCommandToProto(
      AgentCommand{.sequence = 6,
                   .body = ReleaseBlocksCommand{.tier = Tier::kHost, .block_ids = {9}}},
      99, &out);
  ASSERT_TRUE(out.has_release());
  EXPECT_EQ(out.release().tier(), v1::TIER_HOST);
  EXPECT_THAT(out.release().block_ids(), ::testing::ElementsAre(9));
}

TEST(AgentCommandConvertTest, AcksFromProto) {
  v1::AgentCommandAck ack;
  ack.set_sequence(9);
  ack.add_block_ids(30);
  AgentCommandAck got = AgentCommandAckFromProto(ack);
  EXPECT_EQ(got.sequence, 9u);
  EXPECT_TRUE(got.status.ok());
  EXPECT_THAT(got.block_ids, ::testing::ElementsAre(30));

  ack.set_code(static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
  ack.set_message("host pool full");
  got = AgentCommandAckFromProto(ack);
  EXPECT_EQ(got.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(got.status.message(), "host pool full");
  ack.set_code(99);
  EXPECT_EQ(AgentCommandAckFromProto(ack).status.code(), absl::StatusCode::kUnknown);
}

}  // namespace
}  // namespace kvcm
