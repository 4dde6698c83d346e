// EngineSessions: sessions start from nothing, requests apply in sequence exactly once, a gap
// or an unknown session is refused so the bridge starts over, refusals change nothing, and
// a session nobody renews ends with its pools emptied.
#include "server/core/engine_sessions.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kPage = 4;

class EngineSessionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    index_ = std::make_unique<CacheIndex>(CacheIndexOptions{.clock = &clock_});
    ModelSpec spec{.attention = AttentionKind::kMla,
                   .num_layers = 61,
                   .num_heads = 128,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .page_size_tokens = kPage};
    ASSERT_TRUE(index_->RegisterModel(ns_, spec).ok());
    ASSERT_TRUE(index_->RegisterModel(other_ns_, spec).ok());
    sessions_ = std::make_unique<EngineSessions>(index_.get(), &clock_, absl::Seconds(30));
  }

  std::vector<PageHash> Chain(std::vector<int32_t> page_ids, const NamespaceId& ns) {
    std::vector<int32_t> tokens;
    for (int32_t id : page_ids) tokens.insert(tokens.end(), kPage, id);
    return *index_->HashTokens(ns, tokens);
  }

  EngineChange Stored(std::vector<int32_t> ids, Tier tier = Tier::kGpu) {
    return {EngineChange::Kind::kStored, tier, Chain(std::move(ids), ns_)};
  }
  EngineChange Removed(std::vector<int32_t> ids, Tier tier = Tier::kGpu) {
    return {EngineChange::Kind::kRemoved, tier, Chain(std::move(ids), ns_)};
  }

  absl::StatusOr<EnginePublishResult> Publish(uint64_t session, uint64_t sequence,
                                              std::vector<EngineChange> changes,
                                              bool close = false) {
    return sessions_->Publish(EnginePublish{.engine_id = "vllm-0",
                                            .ns = ns_,
                                            .session = session,
                                            .sequence = sequence,
                                            .changes = std::move(changes),
                                            .close = close});
  }

  uint32_t Cached(std::vector<int32_t> ids) {
    absl::StatusOr<MatchResult> m = index_->Match(ns_, Chain(std::move(ids), ns_), {.probe = true});
    return m.ok() ? m->matched_pages : 0;
  }

  uint64_t EnginePages() {
    return index_->PoolPages({"vllm-0", Tier::kGpu}) + index_->PoolPages({"vllm-0", Tier::kHost});
  }

  FakeClock clock_;
  std::unique_ptr<CacheIndex> index_;
  std::unique_ptr<EngineSessions> sessions_;
  const NamespaceId ns_{"acme", "llama"};
  const NamespaceId other_ns_{"acme", "other"};
};

TEST_F(EngineSessionsTest, RequestsApplyInSequenceAndADuplicateOnce) {
  absl::StatusOr<EnginePublishResult> r = Publish(7, 1, {Stored({1, 2, 3})});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->new_session);
  EXPECT_EQ(r->stored_pages, 3u);
  EXPECT_EQ(r->pages, 3u);
  r = Publish(7, 2, {Removed({1, 2}), Stored({1, 5}, Tier::kHost)});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->removed_pages, 2u);
  EXPECT_EQ(r->stored_pages, 2u);
  EXPECT_EQ(Cached({1, 2, 3}), 1u);
  // The same request again (its answer was lost): nothing applied twice.
  r = Publish(7, 2, {Removed({1, 2}), Stored({1, 5}, Tier::kHost)});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->duplicate);
  EXPECT_EQ(r->stored_pages, 0u);
  EXPECT_EQ(EnginePages(), 3u);
  ASSERT_TRUE(Publish(7, 3, {}).ok());  // a heartbeat
  ASSERT_EQ(sessions_->Snapshot().size(), 1u);
  EXPECT_EQ(sessions_->Snapshot()[0].sequence, 3u);
  EXPECT_EQ(sessions_->Snapshot()[0].pages, 3u);
}

TEST_F(EngineSessionsTest, AGapOrAnUnknownSessionIsRefusedAndChangesNothing) {
  ASSERT_TRUE(Publish(7, 1, {Stored({1, 2})}).ok());
  absl::StatusOr<EnginePublishResult> r = Publish(7, 3, {Stored({4})});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("sequence: engine vllm-0 session 7 expected 2"));
  r = Publish(8, 2, {Stored({4})});  // e.g. after a manager restart
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("sequence: session 8"));
  EXPECT_EQ(EnginePages(), 2u);
  EXPECT_EQ(Cached({4}), 0u);
  EXPECT_EQ(sessions_->Snapshot()[0].session, 7u);
  // The session goes on.
  ASSERT_TRUE(Publish(7, 2, {Stored({4})}).ok());
  EXPECT_EQ(Cached({4}), 1u);
}

TEST_F(EngineSessionsTest, ANewSessionStartsFromNothing) {
  ASSERT_TRUE(Publish(7, 1, {Stored({1, 2}), Stored({3}, Tier::kHost)}).ok());
  absl::StatusOr<EnginePublishResult> r = Publish(9, 1, {Stored({5, 6})});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->new_session);
  EXPECT_EQ(Cached({1, 2}), 0u);
  EXPECT_EQ(Cached({3}), 0u);
  EXPECT_EQ(Cached({5, 6}), 2u);
  EXPECT_EQ(EnginePages(), 2u);
  // The old session is over.
  EXPECT_EQ(Publish(7, 2, {}).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(EngineSessionsTest, RefusalsBeforeApplyingChangeNothing) {
  ASSERT_TRUE(Publish(7, 1, {Stored({1, 2})}).ok());
  // Another namespace in the same session.
  absl::StatusOr<EnginePublishResult> r =
      sessions_->Publish({.engine_id = "vllm-0", .ns = other_ns_, .session = 7, .sequence = 2});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("namespace: engine vllm-0 publishes into"));
  // An unknown namespace.
  r = sessions_->Publish({.engine_id = "vllm-0",
                          .ns = {"acme", "nope"},
                          .session = 11,
                          .sequence = 1,
                          .changes = {Stored({9})}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  // An agent's id.
  ASSERT_TRUE(index_->SetPoolCapacity({"gpu-0", Tier::kHost}, 1 << 30).ok());
  r = sessions_->Publish(
      {.engine_id = "gpu-0", .ns = ns_, .session = 1, .sequence = 1, .changes = {Stored({9})}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("not an engine's"));
  EXPECT_EQ(Cached({9}), 0u);
  EXPECT_EQ(EnginePages(), 2u);
  ASSERT_EQ(sessions_->Snapshot().size(), 1u);
  EXPECT_EQ(sessions_->Snapshot()[0].sequence, 1u);
}

TEST_F(EngineSessionsTest, CloseAndIdleSessionsEmptyTheirPools) {
  ASSERT_TRUE(Publish(7, 1, {Stored({1, 2})}).ok());
  ASSERT_TRUE(Publish(7, 2, {}, /*close=*/true).ok());
  EXPECT_FALSE(sessions_->IsLive("vllm-0"));
  EXPECT_EQ(EnginePages(), 0u);

  ASSERT_TRUE(Publish(8, 1, {Stored({1, 2})}).ok());
  clock_.Advance(absl::Seconds(29));
  EXPECT_TRUE(sessions_->ExpireIdle().empty());
  ASSERT_TRUE(Publish(8, 2, {}).ok());  // a heartbeat renews it
  clock_.Advance(absl::Seconds(29));
  EXPECT_TRUE(sessions_->ExpireIdle().empty());
  clock_.Advance(absl::Seconds(2));
  std::vector<EngineSessionInfo> ended = sessions_->ExpireIdle();
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].engine_id, "vllm-0");
  EXPECT_EQ(ended[0].pages, 2u);
  EXPECT_FALSE(sessions_->IsLive("vllm-0"));
  EXPECT_EQ(EnginePages(), 0u);
  EXPECT_EQ(Cached({1, 2}), 0u);
}

TEST_F(EngineSessionsTest, AChangeThatFailsMidwayEndsTheSession) {
  ASSERT_TRUE(Publish(7, 1, {Stored({1, 2})}).ok());
  // The namespace goes between the checks and the changes: here, before the call, with a
  // change list whose first entry applies and whose second cannot (no pages).
  absl::StatusOr<EnginePublishResult> r =
      Publish(7, 2, {Stored({3}), EngineChange{EngineChange::Kind::kStored, Tier::kGpu, {}}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("changes[1]: "));
  EXPECT_FALSE(sessions_->IsLive("vllm-0"));
  EXPECT_EQ(EnginePages(), 0u);
}

TEST_F(EngineSessionsTest, APublishPastTheEngineCapEndsTheSessionAndFreesItsPages) {
  index_ = std::make_unique<CacheIndex>(
      CacheIndexOptions{.max_engine_pages_per_engine = 4, .clock = &clock_});
  ASSERT_TRUE(index_
                  ->RegisterModel(ns_, {.attention = AttentionKind::kMla,
                                        .num_layers = 61,
                                        .num_heads = 128,
                                        .kv_lora_rank = 512,
                                        .rope_dim = 64,
                                        .page_size_tokens = kPage})
                  .ok());
  sessions_ = std::make_unique<EngineSessions>(index_.get(), &clock_, absl::Seconds(30));
  ASSERT_TRUE(Publish(7, 1, {Stored({1, 2, 3})}).ok());
  absl::StatusOr<EnginePublishResult> r = Publish(7, 2, {Stored({1, 2, 3, 4}), Stored({5, 6})});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("changes[1]: max_engine_pages_per_engine"));
  // The manager no longer knows what the engine holds: its pools are emptied, and the
  // index's memory of them with them.
  EXPECT_FALSE(sessions_->IsLive("vllm-0"));
  EXPECT_EQ(EnginePages(), 0u);
  EXPECT_EQ(index_->Stats().tenants[0].engine_pages, 0u);
  EXPECT_EQ(index_->Stats().namespaces[0].radix_nodes, 0u);
  // A new session within the cap works.
  EXPECT_TRUE(Publish(8, 1, {Stored({1, 2, 3, 4})}).ok());
  EXPECT_EQ(EnginePages(), 4u);
  // Closing it frees the pages too.
  ASSERT_TRUE(Publish(8, 2, {}, /*close=*/true).ok());
  EXPECT_EQ(EnginePages(), 0u);
  EXPECT_EQ(index_->Stats().namespaces[0].radix_nodes, 0u);
  EXPECT_TRUE(index_->CheckTenantAccounting().ok());
}

}  // namespace
}  // namespace kvcm
