// The CacheManager service end to end: a real ManagerServer on 127.0.0.1:0 and the generated
// stub over a loopback channel. Every rejected call must leave Stats unchanged.
#include <arpa/inet.h>
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/credentials.h"
#include "common/page_hash.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcm/v1/cache_manager.grpc.pb.h"
#include "server/service/manager_server.h"
#include "tests/util/http_get.h"
#include "tests/util/mla_spec.h"

namespace kvcm {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::kvcm::testing::HttpGet;
using ::kvcm::testing::MlaSpecProto;
using ::testing::HasSubstr;

constexpr uint32_t kPageSize = 16;
constexpr uint32_t kMaxTokens = 1024;
constexpr uint32_t kMaxPages = 32;

class ServiceRpcTest : public ::testing::Test {
 protected:
  // Only the /metrics test serves metrics: stopping the exporter takes civetweb up to 2 s.
  virtual bool ServeMetrics() const { return false; }
  virtual uint32_t MaxEventQueue() const { return 4096; }

  void SetUp() override {
    ServerOptions options;
    options.tls.insecure = true;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = ServeMetrics() ? "127.0.0.1:0" : "";
    options.hash_secret_hex = "000102030405060708090a0b0c0d0e0f";
    options.max_tokens_per_request = kMaxTokens;
    options.max_pages_per_request = kMaxPages;
    options.max_message_bytes = 64 << 10;
    options.lease_sweep_interval_ms = 10;
    options.shutdown_grace_ms = 1000;
    options.max_event_queue = MaxEventQueue();
    absl::StatusOr<std::unique_ptr<ManagerServer>> server = ManagerServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_GT(server_->port(), 0);
    ASSERT_EQ(server_->metrics_port() > 0, ServeMetrics());
    channel_ = MakeInsecureChannel(absl::StrCat("127.0.0.1:", server_->port()));
    stub_ = v1::CacheManager::NewStub(channel_);
    ns_.set_tenant("acme");
    ns_.set_model("deepseek-v3");
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  // DeepSeek-V3's MLA geometry with 16-token pages.
  v1::RegisterModelResponse Register() {
    v1::RegisterModelResponse resp;
    grpc::Status s = TryRegister(&resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  grpc::Status TryRegister(v1::RegisterModelResponse* resp, const std::string& kv_layout = "") {
    v1::RegisterModelRequest req;
    *req.mutable_namespace_() = ns_;
    *req.mutable_spec() = MlaSpecProto(kPageSize);
    req.mutable_spec()->set_kv_layout(kv_layout);
    grpc::ClientContext ctx;
    return stub_->RegisterModel(&ctx, req, resp);
  }

  static std::vector<int32_t> Tokens(int n, int32_t first = 100) {
    std::vector<int32_t> t(n);
    for (int i = 0; i < n; ++i) t[i] = first + i;
    return t;
  }

  v1::Prompt TokenPrompt(const std::vector<int32_t>& tokens) {
    v1::Prompt p;
    p.mutable_tokens()->mutable_ids()->Add(tokens.begin(), tokens.end());
    return p;
  }

  // Hashed on the client side with the namespace's key, as the client library does.
  v1::Prompt HashPrompt(const v1::RegisterModelResponse& reg, const std::vector<int32_t>& tokens) {
    v1::Prompt p;
    p.set_page_hashes(
        EncodePageHashes(HashPages(HashKey::FromBytes(reg.hash_key()), tokens, kPageSize)));
    *p.mutable_scheme() = reg.scheme();
    return p;
  }

  grpc::Status Insert(const v1::Prompt& prompt, std::vector<uint32_t> blocks,
                      v1::InsertResponse* resp, const std::string& agent = "gpu-0") {
    v1::InsertRequest req;
    *req.mutable_namespace_() = ns_;
    *req.mutable_prompt() = prompt;
    req.mutable_pool()->set_agent_id(agent);
    req.mutable_pool()->set_tier(v1::TIER_GPU);
    req.mutable_block_ids()->Add(blocks.begin(), blocks.end());
    grpc::ClientContext ctx;
    return stub_->Insert(&ctx, req, resp);
  }

  grpc::Status Match(const v1::Prompt& prompt, bool pin, v1::MatchResponse* resp,
                     uint32_t lease_ttl_ms = 0) {
    v1::MatchRequest req;
    *req.mutable_namespace_() = ns_;
    *req.mutable_prompt() = prompt;
    req.set_pin(pin);
    req.set_lease_ttl_ms(lease_ttl_ms);
    req.set_requester_agent_id("gpu-0");
    grpc::ClientContext ctx;
    return stub_->Match(&ctx, req, resp);
  }

  v1::StatsResponse Stats() {
    v1::StatsResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = stub_->Stats(&ctx, v1::StatsRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  // Runs `call`, expects `code` with a message containing `message_part`, and checks that
  // the index is exactly as before.
  template <typename Call>
  void ExpectRejected(const std::string& what, grpc::StatusCode code,
                      const std::string& message_part, Call call) {
    SCOPED_TRACE(what);
    const v1::StatsResponse before = Stats();
    grpc::Status status = call();
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(message_part));
    const v1::StatsResponse after = Stats();
    EXPECT_TRUE(MessageDifferencer::Equals(before, after)) << "before:\n"
                                                           << before.DebugString() << "after:\n"
                                                           << after.DebugString();
  }

  std::unique_ptr<ManagerServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::CacheManager::Stub> stub_;
  v1::Namespace ns_;
};

TEST_F(ServiceRpcTest, RegisterInsertMatchRelease) {
  const v1::RegisterModelResponse reg = Register();
  EXPECT_TRUE(reg.created());
  EXPECT_EQ(reg.bytes_per_token(), 70'272u);  // DeepSeek-V3 MLA bf16
  EXPECT_EQ(reg.bytes_per_page(), 70'272u * kPageSize);
  EXPECT_EQ(reg.hash_key().size(), 16u);
  EXPECT_EQ(reg.scheme().page_size_tokens(), kPageSize);
  EXPECT_FALSE(Register().created()) << "registering the same spec again confirms it";

  const std::vector<int32_t> tokens = Tokens(2 * kPageSize + 5);  // 2 whole pages
  v1::InsertResponse ins;
  grpc::Status s = Insert(TokenPrompt(tokens), {10, 11}, &ins);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(ins.new_pages(), 2u);
  EXPECT_EQ(ins.already_present_pages(), 0u);

  v1::MatchResponse by_tokens;
  s = Match(TokenPrompt(tokens), /*pin=*/true, &by_tokens);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(by_tokens.matched_pages(), 2u);
  EXPECT_EQ(by_tokens.matched_tokens(), 2 * kPageSize);
  EXPECT_EQ(by_tokens.prompt_pages(), 2u);
  EXPECT_EQ(by_tokens.local_pages(), 2u);
  ASSERT_EQ(by_tokens.segments_size(), 1);
  ASSERT_EQ(by_tokens.segments(0).replicas_size(), 1);
  EXPECT_EQ(by_tokens.segments(0).replicas(0).pool().agent_id(), "gpu-0");
  EXPECT_THAT(by_tokens.segments(0).replicas(0).block_ids(), ::testing::ElementsAre(10, 11));
  EXPECT_NE(by_tokens.pin_id(), 0u);
  EXPECT_GT(by_tokens.lease_expiry_unix_ms(), absl::ToUnixMillis(absl::Now()));

  v1::MatchResponse by_hashes;  // same prompt hashed by the client: same answer
  s = Match(HashPrompt(reg, tokens), /*pin=*/false, &by_hashes);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(by_hashes.matched_pages(), 2u);
  EXPECT_EQ(by_hashes.pin_id(), 0u);

  v1::InsertResponse again;  // idempotent
  ASSERT_TRUE(Insert(HashPrompt(reg, tokens), {20, 21}, &again).ok());
  EXPECT_EQ(again.already_present_pages(), 2u);
  EXPECT_THAT(again.existing_block_ids(), ::testing::ElementsAre(10, 11));

  v1::StatsResponse stats = Stats();
  ASSERT_EQ(stats.pools_size(), 1);
  EXPECT_EQ(stats.pools(0).used_bytes(), 2 * reg.bytes_per_page());
  EXPECT_EQ(stats.pools(0).pinned_bytes(), 2 * reg.bytes_per_page());
  EXPECT_EQ(stats.active_pins(), 1u);
  EXPECT_EQ(stats.policy(), ServerOptions{}.policy);  // the default
  EXPECT_EQ(stats.limits().max_tokens_per_request(), kMaxTokens);
  EXPECT_EQ(stats.limits().max_pages_per_request(), kMaxPages);
  EXPECT_EQ(stats.counters().matched_tokens(), 4 * kPageSize);

  {
    v1::RenewLeaseRequest req;
    *req.mutable_namespace_() = ns_;
    req.set_pin_id(by_tokens.pin_id());
    req.set_lease_ttl_ms(60'000);
    v1::RenewLeaseResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->RenewLease(&ctx, req, &resp).ok());
    EXPECT_GE(resp.lease_expiry_unix_ms(), by_tokens.lease_expiry_unix_ms());
  }
  v1::ReleaseRequest release;
  *release.mutable_namespace_() = ns_;
  release.set_pin_id(by_tokens.pin_id());
  v1::ReleaseResponse released;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->Release(&ctx, release, &released).ok());
  stats = Stats();
  EXPECT_EQ(stats.active_pins(), 0u);
  EXPECT_EQ(stats.pools(0).pinned_bytes(), 0u);
  EXPECT_EQ(stats.counters().pins_released(), 1u);
}

TEST_F(ServiceRpcTest, BadInputIsRejectedAndChangesNothing) {
  const v1::RegisterModelResponse reg = Register();
  const std::vector<int32_t> tokens = Tokens(3 * kPageSize);
  v1::InsertResponse ins;
  ASSERT_TRUE(Insert(TokenPrompt(tokens), {1, 2, 3}, &ins).ok());
  v1::MatchResponse match;

  ExpectRejected("empty prompt", grpc::StatusCode::INVALID_ARGUMENT, "prompt is empty",
                 [&] { return Match(v1::Prompt(), true, &match); });
  ExpectRejected("empty token list", grpc::StatusCode::INVALID_ARGUMENT, "prompt.tokens is empty",
                 [&] { return Match(TokenPrompt({}), true, &match); });
  ExpectRejected("unknown namespace", grpc::StatusCode::NOT_FOUND, "not registered", [&] {
    ns_.set_model("no-such-model");
    grpc::Status s = Insert(TokenPrompt(tokens), {1, 2, 3}, &ins);
    ns_.set_model("deepseek-v3");
    return s;
  });
  ExpectRejected("invalid tenant", grpc::StatusCode::INVALID_ARGUMENT, "namespace.tenant", [&] {
    ns_.set_tenant("a tenant");
    grpc::Status s = Match(TokenPrompt(tokens), true, &match);
    ns_.set_tenant("acme");
    return s;
  });
  ExpectRejected("page size mismatch", grpc::StatusCode::INVALID_ARGUMENT,
                 "prompt.scheme.page_size_tokens", [&] {
                   v1::Prompt p = HashPrompt(reg, tokens);
                   p.mutable_scheme()->set_page_size_tokens(kPageSize * 2);
                   return Insert(p, {4, 5, 6}, &ins);
                 });
  ExpectRejected("foreign hash key", grpc::StatusCode::FAILED_PRECONDITION,
                 "prompt.scheme.key_fingerprint", [&] {
                   v1::Prompt p = HashPrompt(reg, tokens);
                   p.mutable_scheme()->set_key_fingerprint(reg.scheme().key_fingerprint() + 1);
                   return Match(p, true, &match);
                 });
  ExpectRejected("oversize token prompt", grpc::StatusCode::INVALID_ARGUMENT,
                 "max_tokens_per_request (1024)",
                 [&] { return Match(TokenPrompt(Tokens(kMaxTokens + 1)), true, &match); });
  ExpectRejected(
      "oversize hash prompt", grpc::StatusCode::INVALID_ARGUMENT, "max_pages_per_request (32)",
      [&] { return Match(HashPrompt(reg, Tokens((kMaxPages + 1) * kPageSize)), true, &match); });
  ExpectRejected("malformed hashes", grpc::StatusCode::INVALID_ARGUMENT,
                 "prompt.page_hashes length 17 is not a multiple of 16", [&] {
                   v1::Prompt p = HashPrompt(reg, tokens);
                   p.set_page_hashes(std::string(17, '\x01'));
                   return Match(p, true, &match);
                 });
  ExpectRejected("block count", grpc::StatusCode::INVALID_ARGUMENT,
                 "block_ids has 2 entries, expected 3", [&] {
                   return Insert(TokenPrompt(Tokens(3 * kPageSize, 7)), {8, 9}, &ins);
                 });
  ExpectRejected("unspecified tier", grpc::StatusCode::INVALID_ARGUMENT, "pool.tier", [&] {
    v1::InsertRequest req;
    *req.mutable_namespace_() = ns_;
    *req.mutable_prompt() = TokenPrompt(Tokens(kPageSize, 9));
    req.mutable_pool()->set_agent_id("gpu-0");
    req.add_block_ids(1);
    grpc::ClientContext ctx;
    return stub_->Insert(&ctx, req, &ins);
  });
  ExpectRejected("probe and pin", grpc::StatusCode::INVALID_ARGUMENT, "probe and pin", [&] {
    v1::MatchRequest req;
    *req.mutable_namespace_() = ns_;
    *req.mutable_prompt() = TokenPrompt(tokens);
    req.set_pin(true);
    req.set_probe(true);
    grpc::ClientContext ctx;
    return stub_->Match(&ctx, req, &match);
  });
  ExpectRejected("lease too long", grpc::StatusCode::INVALID_ARGUMENT, "max_lease_ttl_ms",
                 [&] { return Match(TokenPrompt(tokens), true, &match, 600'001); });
  ExpectRejected("unknown pin", grpc::StatusCode::NOT_FOUND, "", [&] {
    v1::ReleaseRequest req;
    *req.mutable_namespace_() = ns_;
    req.set_pin_id(987654321);
    v1::ReleaseResponse resp;
    grpc::ClientContext ctx;
    return stub_->Release(&ctx, req, &resp);
  });
  ExpectRejected("evict more than the pool holds", grpc::StatusCode::OUT_OF_RANGE, "", [&] {
    v1::EvictRequest req;
    req.mutable_pool()->set_agent_id("gpu-0");
    req.mutable_pool()->set_tier(v1::TIER_GPU);
    req.set_bytes(4 * reg.bytes_per_page());
    v1::EvictResponse resp;
    grpc::ClientContext ctx;
    return stub_->Evict(&ctx, req, &resp);
  });
  ExpectRejected("evict without target", grpc::StatusCode::INVALID_ARGUMENT, "target", [&] {
    v1::EvictRequest req;
    req.set_bytes(1);
    v1::EvictResponse resp;
    grpc::ClientContext ctx;
    return stub_->Evict(&ctx, req, &resp);
  });
  ExpectRejected("message over max_message_bytes", grpc::StatusCode::RESOURCE_EXHAUSTED, "", [&] {
    v1::Prompt p;
    p.set_page_hashes(std::string(80 << 10, '\0'));  // 80 KiB > 64 KiB receive limit
    return Match(p, true, &match);
  });

  // The failures were counted by code.
  const std::string text = server_->metrics().RenderText();
  EXPECT_THAT(text, HasSubstr("kvcm_rpc_requests_total{code=\"INVALID_ARGUMENT\",rpc=\"Match\"}"));
  EXPECT_THAT(text, HasSubstr("kvcm_rpc_requests_total{code=\"NOT_FOUND\",rpc=\"Release\"} 1"));
}

// Reads the next event, failing the test if the stream ends first.
v1::CacheEvent ReadEvent(grpc::ClientReader<v1::CacheEvent>* reader) {
  v1::CacheEvent event;
  EXPECT_TRUE(reader->Read(&event)) << "stream ended early";
  return event;
}

TEST_F(ServiceRpcTest, ATenantCannotCreateNamespacesWithoutBound) {
  // The default cap (max_namespaces_per_tenant = 64), reached the way an attacker would.
  for (int i = 0; i < 64; ++i) {
    ns_.set_model(absl::StrCat("model-", i));
    ASSERT_TRUE(Register().created());
  }
  ns_.set_model("model-64");
  v1::RegisterModelResponse resp;
  const grpc::Status refused = TryRegister(&resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("max_namespaces_per_tenant"));
  EXPECT_EQ(Stats().namespaces_size(), 64) << "the refused namespace was not created";
  // Other tenants are not affected.
  ns_.set_tenant("other");
  EXPECT_TRUE(Register().created());
}

// Equal specs whose pages' bytes are laid out differently must not share a namespace; an
// unstated layout (a router, kvcmctl) is compatible with any.
TEST_F(ServiceRpcTest, RegisterModelKeepsOneKvLayoutPerNamespace) {
  constexpr char kCpu[] = "vllm-cpu/mla:[block,576]:bf16";
  constexpr char kFlash[] = "flash-mla:[block,576]:bf16";
  v1::RegisterModelResponse resp;
  ASSERT_TRUE(TryRegister(&resp).ok());
  EXPECT_TRUE(resp.created());
  EXPECT_EQ(resp.spec().kv_layout(), "");
  ASSERT_TRUE(TryRegister(&resp, kCpu).ok());
  EXPECT_FALSE(resp.created());
  EXPECT_EQ(resp.spec().kv_layout(), kCpu) << "the namespace takes the first layout stated";
  ASSERT_TRUE(TryRegister(&resp).ok());
  EXPECT_EQ(resp.spec().kv_layout(), kCpu) << "an unstated layout gets the stored one";
  ASSERT_EQ(Stats().namespaces(0).spec().kv_layout(), kCpu);

  ExpectRejected("another layout", grpc::StatusCode::FAILED_PRECONDITION,
                 absl::StrCat("namespace acme/deepseek-v3 is registered with kv_layout \"", kCpu,
                              "\"; this spec has \"", kFlash, "\""),
                 [&] { return TryRegister(&resp, kFlash); });
  ExpectRejected("too long", grpc::StatusCode::INVALID_ARGUMENT, "spec.kv_layout",
                 [&] { return TryRegister(&resp, std::string(257, 'x')); });
  ExpectRejected("not printable", grpc::StatusCode::INVALID_ARGUMENT, "spec.kv_layout",
                 [&] { return TryRegister(&resp, "vllm\x01 cpu"); });
  ns_.set_model("fresh");
  ExpectRejected("not ASCII", grpc::StatusCode::INVALID_ARGUMENT, "spec.kv_layout",
                 [&] { return TryRegister(&resp, "caf\xc3\xa9"); });
}

TEST_F(ServiceRpcTest, WatchEventsStreamsStoredThenRemoved) {
  const v1::RegisterModelResponse reg = Register();
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  v1::WatchEventsRequest watch;
  *watch.mutable_namespace_() = ns_;
  std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> reader =
      stub_->WatchEvents(&watch_ctx, watch);
  reader->WaitForInitialMetadata();  // subscribed from here on

  // Events of another namespace are filtered out.
  v1::Namespace saved = ns_;
  ns_.set_model("other-model");
  Register();
  v1::InsertResponse ins;
  ASSERT_TRUE(Insert(TokenPrompt(Tokens(kPageSize)), {99}, &ins).ok());
  ns_ = saved;

  const std::vector<int32_t> tokens = Tokens(2 * kPageSize);
  ASSERT_TRUE(Insert(TokenPrompt(tokens), {1, 2}, &ins).ok());
  const std::string hashes = HashPrompt(reg, tokens).page_hashes();

  v1::CacheEvent stored = ReadEvent(reader.get());
  EXPECT_EQ(stored.kind(), v1::CacheEvent::KIND_STORED);
  EXPECT_EQ(stored.namespace_().model(), "deepseek-v3");
  EXPECT_EQ(stored.pool().agent_id(), "gpu-0");
  EXPECT_EQ(stored.pool().tier(), v1::TIER_GPU);
  EXPECT_EQ(stored.page_hashes(), hashes);

  v1::EvictRequest evict;
  *evict.mutable_namespace_() = ns_;
  evict.set_bytes(2 * reg.bytes_per_page());
  v1::EvictResponse evicted;
  grpc::ClientContext evict_ctx;
  grpc::Status s = stub_->Evict(&evict_ctx, evict, &evicted);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(evicted.evicted_pages(), 2u);

  v1::CacheEvent removed = ReadEvent(reader.get());
  EXPECT_EQ(removed.kind(), v1::CacheEvent::KIND_REMOVED);
  EXPECT_EQ(removed.page_hashes(), hashes);
  EXPECT_GT(removed.sequence(), stored.sequence());

  watch_ctx.TryCancel();
  v1::CacheEvent ignored;
  while (reader->Read(&ignored)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

class ServiceRpcSmallQueueTest : public ServiceRpcTest {
 protected:
  uint32_t MaxEventQueue() const override { return 4; }
};

TEST_F(ServiceRpcSmallQueueTest, SubscriberThatFallsBehindIsEndedWithResourceExhausted) {
  Register();
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> reader =
      stub_->WatchEvents(&watch_ctx, v1::WatchEventsRequest());
  reader->WaitForInitialMetadata();

  // The client reads nothing while the index changes 3000 times (~200 B per event): HTTP/2
  // flow control (64 KiB stream window) stalls the writes, and the 4-event queue overflows.
  NamespaceId ns{ns_.tenant(), ns_.model()};
  constexpr int kInserts = 3000;
  for (int i = 0; i < kInserts; ++i) {
    absl::StatusOr<std::vector<PageHash>> pages =
        server_->index().HashTokens(ns, Tokens(8 * kPageSize, i * 1000));
    ASSERT_TRUE(pages.ok());
    std::vector<BlockId> blocks(pages->size(), static_cast<BlockId>(i));
    ASSERT_TRUE(server_->index().Insert(ns, *pages, PoolKey{"gpu-0", Tier::kGpu}, blocks).ok());
  }

  int received = 0;
  uint64_t last_sequence = 0;
  v1::CacheEvent event;
  while (reader->Read(&event)) {
    if (received > 0) {
      EXPECT_EQ(event.sequence(), last_sequence + 1) << "events before the overflow are contiguous";
    }
    last_sequence = event.sequence();
    ++received;
  }
  grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("resubscribe"));
  EXPECT_LT(received, kInserts);
  EXPECT_THAT(server_->metrics().RenderText(), HasSubstr("kvcm_watch_overflows_total 1"));
}

TEST_F(ServiceRpcTest, ShutdownEndsWatchStreamsAndIsIdempotent) {
  grpc::ClientContext watch_ctx;
  std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> reader =
      stub_->WatchEvents(&watch_ctx, v1::WatchEventsRequest());
  reader->WaitForInitialMetadata();
  server_->Shutdown();
  v1::CacheEvent ignored;
  EXPECT_FALSE(reader->Read(&ignored));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  server_->Shutdown();
  server_->Wait();  // returns at once: shutdown is complete
}

TEST_F(ServiceRpcTest, BadWatchFilterIsInvalidArgument) {
  grpc::ClientContext ctx;
  v1::WatchEventsRequest watch;
  watch.mutable_namespace_()->set_tenant("bad tenant");
  watch.mutable_namespace_()->set_model("m");
  std::unique_ptr<grpc::ClientReader<v1::CacheEvent>> reader = stub_->WatchEvents(&ctx, watch);
  v1::CacheEvent ignored;
  EXPECT_FALSE(reader->Read(&ignored));
  grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("namespace.tenant"));
}

TEST_F(ServiceRpcTest, LeaseSweeperExpiresIdlePins) {
  Register();
  const std::vector<int32_t> tokens = Tokens(kPageSize);
  v1::InsertResponse ins;
  ASSERT_TRUE(Insert(TokenPrompt(tokens), {1}, &ins).ok());
  v1::MatchResponse match;
  ASSERT_TRUE(Match(TokenPrompt(tokens), true, &match, /*lease_ttl_ms=*/20).ok());
  ASSERT_NE(match.pin_id(), 0u);
  // No call touches the index from here on; only the 10 ms sweeper can expire the pin.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (server_->index().Stats().active_pins != 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const IndexStats stats = server_->index().Stats();
  EXPECT_EQ(stats.active_pins, 0u);
  EXPECT_EQ(stats.counters.lease_expiries, 1u);
}

TEST_F(ServiceRpcTest, BusyPortIsUnavailable) {
  ServerOptions options;
  options.tls.insecure = true;
  options.listen_address = absl::StrCat("127.0.0.1:", server_->port());
  options.metrics_address = "";
  absl::StatusOr<std::unique_ptr<ManagerServer>> second = ManagerServer::Start(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
}

class ServiceRpcMetricsTest : public ServiceRpcTest {
 protected:
  bool ServeMetrics() const override { return true; }
};

TEST_F(ServiceRpcMetricsTest, MetricsEndpointServesPoolUsage) {
  Register();
  v1::InsertResponse ins;
  ASSERT_TRUE(Insert(TokenPrompt(Tokens(kPageSize)), {1}, &ins).ok());
  const std::string response = HttpGet(server_->metrics_port(), "/metrics");
  EXPECT_THAT(response, HasSubstr("200 OK"));
  EXPECT_THAT(response,
              HasSubstr(absl::StrCat("kvcm_pool_used_bytes{agent=\"gpu-0\",tier=\"gpu\"} ",
                                     70'272 * kPageSize)));
  EXPECT_THAT(response, HasSubstr("kvcm_rpc_requests_total{code=\"OK\",rpc=\"Insert\"} 1"));
  EXPECT_THAT(response,
              HasSubstr(absl::StrCat("kvcm_build_info{policy=\"", ServerOptions{}.policy, "\"")));
}

}  // namespace
}  // namespace kvcm
