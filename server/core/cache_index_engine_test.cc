// Engine pools: the prefix caches of engines that keep their own KV, changed only by their
// events. Stores, removals of a page with everything under it, clears; that the manager
// never evicts, expires, reserves, quota-charges or Inserts into them; removals under pins;
// and a randomized run against a model of what the engine holds.
#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/cache_index.h"
#include "tests/util/match_replicas.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kPage = 4;  // tokens per page

ModelSpec Mla() {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = 61,
                   .num_heads = 128,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .page_size_tokens = kPage};
}

class CacheIndexEngineTest : public ::testing::Test {
 protected:
  void SetUp() override { Reset({}); }

  void Reset(CacheIndexOptions options) {
    options.clock = &clock_;
    options.hash_secret = HashKey{5, 6};
    index_ = std::make_unique<CacheIndex>(options);
    index_->SetEventListener([this](const CacheEvent& e) { events_.push_back(e); });
    ASSERT_TRUE(index_->RegisterModel(ns_, Mla()).ok());
    bpp_ = index_->GetNamespace(ns_)->spec.BytesPerPage();
  }

  std::vector<PageHash> Chain(std::vector<int32_t> page_ids) {
    std::vector<int32_t> tokens;
    for (int32_t id : page_ids) tokens.insert(tokens.end(), kPage, id);
    return *index_->HashTokens(ns_, tokens);
  }

  uint64_t Store(std::vector<int32_t> ids, const PoolKey& pool) {
    absl::StatusOr<uint64_t> r = index_->StoreEnginePages(ns_, Chain(std::move(ids)), pool);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.value_or(0);
  }

  uint64_t Remove(std::vector<int32_t> ids, const PoolKey& pool) {
    absl::StatusOr<uint64_t> r = index_->RemoveEnginePages(ns_, Chain(std::move(ids)), pool);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.value_or(0);
  }

  absl::StatusOr<MatchResult> Probe(std::vector<int32_t> ids) {
    return index_->Match(ns_, Chain(std::move(ids)), {.probe = true});
  }

  uint32_t Cached(std::vector<int32_t> ids) {
    absl::StatusOr<MatchResult> m = Probe(std::move(ids));
    return m.ok() ? m->matched_pages : 0;
  }

  PoolStats PoolOf(const PoolKey& key) {
    for (const PoolStats& p : index_->Stats().pools) {
      if (p.pool == key) return p;
    }
    ADD_FAILURE() << "no pool " << key.ToString();
    return {};
  }

  FakeClock clock_;
  std::unique_ptr<CacheIndex> index_;
  std::vector<CacheEvent> events_;
  const NamespaceId ns_{"acme", "deepseek-v3"};
  const PoolKey vllm0_{"vllm-0", Tier::kGpu};
  const PoolKey vllm0_cpu_{"vllm-0", Tier::kHost};
  const PoolKey gpu0_{"gpu-0", Tier::kGpu};
  uint64_t bpp_ = 0;
};

TEST_F(CacheIndexEngineTest, StoredChainMatchesInTheEnginePoolWithNoBlocks) {
  EXPECT_EQ(Store({1, 2, 3}, vllm0_), 3u);
  EXPECT_EQ(Store({1, 2, 3}, vllm0_), 0u);  // idempotent
  EXPECT_EQ(Store({1, 2, 3, 4}, vllm0_), 1u);
  absl::StatusOr<MatchResult> m = Probe({1, 2, 3, 4, 5});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->matched_pages, 4u);
  for (const MatchedSegment& seg : m->segments) {
    const std::vector<TestReplica> replicas = ReplicasOf(*m, seg);
    ASSERT_EQ(replicas.size(), 1u);
    EXPECT_EQ(*replicas[0].pool, vllm0_);
    for (BlockId b : replicas[0].block_ids) EXPECT_EQ(b, kNoBlock);
  }
  const PoolStats pool = PoolOf(vllm0_);
  EXPECT_TRUE(pool.engine);
  EXPECT_EQ(pool.capacity_bytes, 0u);
  EXPECT_EQ(pool.pages, 4u);
  EXPECT_EQ(pool.used_bytes, 4 * bpp_);
  // An engine's memory is not the tenant's kvcm bytes.
  ASSERT_EQ(index_->Stats().tenants.size(), 1u);
  EXPECT_EQ(index_->Stats().tenants[0].stored_bytes, 0u);
  EXPECT_TRUE(index_->CheckTenantAccounting().ok());
  ASSERT_EQ(events_.size(), 2u);  // the idempotent store says nothing
  EXPECT_EQ(events_[1].kind, CacheEvent::Kind::kStored);
  EXPECT_EQ(events_[1].pages, std::vector<PageHash>{Chain({1, 2, 3, 4})[3]});
}

TEST_F(CacheIndexEngineTest, RemovalTakesThePageAndEverythingUnderIt) {
  Store({1, 2, 3, 4}, vllm0_);
  Store({1, 2, 7, 8}, vllm0_);
  Store({1, 2, 3, 9}, vllm0_);
  events_.clear();
  // Page 3 of [1,2,3,...] leaves, with 4 and 9 below it; [1,2,7,8] stays.
  EXPECT_EQ(Remove({1, 2, 3}, vllm0_), 3u);
  EXPECT_EQ(Cached({1, 2, 3, 4}), 2u);
  EXPECT_EQ(Cached({1, 2, 3, 9}), 2u);
  EXPECT_EQ(Cached({1, 2, 7, 8}), 4u);
  EXPECT_EQ(PoolOf(vllm0_).pages, 4u);
  uint64_t removed_in_events = 0;
  for (const CacheEvent& e : events_) {
    EXPECT_EQ(e.kind, CacheEvent::Kind::kRemoved);
    EXPECT_TRUE(e.block_ids.empty());  // nothing for an agent to free
    removed_in_events += e.pages.size();
  }
  EXPECT_EQ(removed_in_events, 3u);
  // A page the pool does not hold, or a chain the index never saw: nothing happens.
  EXPECT_EQ(Remove({1, 2, 3}, vllm0_), 0u);
  EXPECT_EQ(Remove({5, 6}, vllm0_), 0u);
  EXPECT_EQ(Remove({1}, {"vllm-9", Tier::kGpu}), 0u);
  EXPECT_EQ(PoolOf(vllm0_).pages, 4u);
  // The root page takes everything.
  EXPECT_EQ(Remove({1}, vllm0_), 4u);
  EXPECT_EQ(PoolOf(vllm0_).pages, 0u);
  EXPECT_EQ(index_->Stats().namespaces[0].radix_nodes, 0u);
}

TEST_F(CacheIndexEngineTest, RemovalKeepsOtherPoolsReplicas) {
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 100 * bpp_).ok());
  ASSERT_TRUE(index_->Insert(ns_, Chain({1, 2, 3}), gpu0_, std::vector<BlockId>{7, 8, 9}).ok());
  Store({1, 2, 3}, vllm0_);
  Store({1, 2, 3}, vllm0_cpu_);
  EXPECT_EQ(Remove({1, 2}, vllm0_), 2u);
  absl::StatusOr<MatchResult> m = Probe({1, 2, 3});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->matched_pages, 3u);
  for (const MatchedSegment& seg : m->segments) {
    for (const MatchedReplica& r : m->Replicas(seg)) {
      if (seg.first_page + seg.num_pages > 1) {
        EXPECT_NE(*r.pool, vllm0_);  // page 0 stays
      }
    }
  }
  EXPECT_EQ(PoolOf(gpu0_).pages, 3u);
  EXPECT_EQ(PoolOf(vllm0_cpu_).pages, 3u);
  EXPECT_EQ(PoolOf(vllm0_).pages, 1u);
}

TEST_F(CacheIndexEngineTest, ClearEmptiesOnePoolOfOneNamespace) {
  Store({1, 2}, vllm0_);
  Store({3, 4, 5}, vllm0_);
  Store({3, 4}, vllm0_cpu_);
  events_.clear();
  absl::StatusOr<uint64_t> cleared = index_->ClearEnginePool(ns_, vllm0_);
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  EXPECT_EQ(*cleared, 5u);
  EXPECT_EQ(Cached({1, 2}), 0u);
  EXPECT_EQ(Cached({3, 4, 5}), 2u);  // the CPU pool still holds [3, 4]
  ASSERT_EQ(events_.size(), 1u);
  EXPECT_EQ(events_[0].kind, CacheEvent::Kind::kCleared);
  EXPECT_EQ(*index_->ClearEnginePool(ns_, vllm0_), 0u);
  EXPECT_EQ(*index_->ClearEnginePool(ns_, {"never-seen", Tier::kGpu}), 0u);
}

TEST_F(CacheIndexEngineTest, AnEngineRemovesPinnedPagesAndThePinHoldsNothing) {
  Store({1, 2, 3}, vllm0_);
  absl::StatusOr<MatchResult> pin = index_->Match(ns_, Chain({1, 2, 3}), {.pin = true});
  ASSERT_TRUE(pin.ok());
  ASSERT_NE(pin->pin_id, 0u);
  EXPECT_EQ(PoolOf(vllm0_).pinned_bytes, 3 * bpp_);
  EXPECT_EQ(Remove({1, 2}, vllm0_), 2u);
  EXPECT_EQ(Cached({1, 2, 3}), 1u);  // the emptied, pinned nodes match nothing
  EXPECT_EQ(PoolOf(vllm0_).pinned_bytes, bpp_);
  absl::StatusOr<absl::Time> renew = index_->RenewLease(ns_, pin->pin_id, absl::Seconds(5));
  EXPECT_EQ(renew.status().code(), absl::StatusCode::kAborted);
  // Stored again while the pin lasts: the emptied nodes are reused.
  EXPECT_EQ(Store({1, 2, 3}, vllm0_), 2u);
  EXPECT_EQ(Cached({1, 2, 3}), 3u);
  EXPECT_EQ(Remove({1}, vllm0_), 3u);
  ASSERT_TRUE(index_->Release(ns_, pin->pin_id).ok());
  EXPECT_EQ(PoolOf(vllm0_).pinned_bytes, 0u);
  EXPECT_EQ(index_->Stats().namespaces[0].radix_nodes, 0u);  // the pin took them with it
  EXPECT_EQ(index_->Stats().namespaces[0].pages, 0u);
}

TEST_F(CacheIndexEngineTest, TheManagerNeverEvictsReservesOrInsertsIntoAnEnginePool) {
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 2 * bpp_).ok());
  Store({1, 2, 3, 4, 5, 6}, vllm0_);
  // Pressure on the agent's pool evicts its own pages only.
  ASSERT_TRUE(index_->Insert(ns_, Chain({1, 2}), gpu0_, std::vector<BlockId>{0, 1}).ok());
  ASSERT_TRUE(index_->Insert(ns_, Chain({9, 8}), gpu0_, std::vector<BlockId>{2, 3}).ok());
  EXPECT_EQ(PoolOf(vllm0_).pages, 6u);
  EXPECT_EQ(Cached({1, 2, 3, 4, 5, 6}), 6u);

  const IndexStats before = index_->Stats();
  absl::StatusOr<EvictResult> evict = index_->EvictFromPool(vllm0_, bpp_);
  EXPECT_EQ(evict.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(evict.status().message(), HasSubstr("engine vllm-0"));
  absl::StatusOr<uint64_t> reserve = index_->Reserve(vllm0_, bpp_, "acme");
  EXPECT_EQ(reserve.status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<InsertResult> insert =
      index_->Insert(ns_, Chain({4, 4}), vllm0_, std::vector<BlockId>{0, 1});
  EXPECT_EQ(insert.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(index_->SetPoolCapacity(vllm0_, 1 << 20).code(), absl::StatusCode::kFailedPrecondition);
  // Nor does an engine take an agent's pool.
  absl::StatusOr<uint64_t> store = index_->StoreEnginePages(ns_, Chain({5}), gpu0_);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(store.status().message(), HasSubstr("not an engine's"));
  EXPECT_EQ(index_->RemoveEnginePages(ns_, Chain({1}), gpu0_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(index_->ClearEnginePool(ns_, gpu0_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const IndexStats after = index_->Stats();
  EXPECT_EQ(after.counters.evicted_pages, before.counters.evicted_pages);
  EXPECT_EQ(PoolOf(vllm0_).pages, 6u);
  EXPECT_EQ(PoolOf(gpu0_).pages, 2u);

  // An operator's namespace eviction reaches the agent's pages, never the engine's.
  absl::StatusOr<EvictResult> ns_evict = index_->EvictFromNamespace(ns_, 3 * bpp_);
  EXPECT_EQ(ns_evict.status().code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(index_->EvictFromNamespace(ns_, 2 * bpp_).ok());
  EXPECT_EQ(PoolOf(vllm0_).pages, 6u);
  EXPECT_EQ(PoolOf(gpu0_).pages, 0u);
}

TEST_F(CacheIndexEngineTest, EnginePagesCountAgainstNoQuotaAndNeverExpire) {
  Reset({.tenant_max_bytes = 2 * bpp_, .default_max_page_age = absl::Seconds(10)});
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 100 * bpp_).ok());
  Store({1, 2, 3, 4, 5}, vllm0_);
  // The tenant's own kvcm bytes are still limited.
  ASSERT_TRUE(index_->Insert(ns_, Chain({7, 8}), gpu0_, std::vector<BlockId>{0, 1}).ok());
  EXPECT_EQ(index_->Stats().tenants[0].stored_bytes, 2 * bpp_);
  clock_.Advance(absl::Seconds(60));
  while (index_->SweepExpired(16).more) {
  }
  EXPECT_EQ(Cached({1, 2, 3, 4, 5}), 5u);  // the engine's retention is the engine's
  EXPECT_EQ(Cached({7, 8}), 0u);           // the agent's pages expired
  EXPECT_TRUE(index_->CheckTenantAccounting().ok());
}

TEST_F(CacheIndexEngineTest, DeleteNamespaceTakesEnginePagesToo) {
  Store({1, 2, 3}, vllm0_);
  ASSERT_TRUE(index_->Match(ns_, Chain({1, 2}), {.pin = true}).ok());
  absl::StatusOr<DeleteNamespaceResult> deleted = index_->DeleteNamespace(ns_);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(deleted->removed_pages, 3u);
  EXPECT_EQ(deleted->dropped_pins, 1u);
  EXPECT_EQ(PoolOf(vllm0_).pages, 0u);
  EXPECT_EQ(PoolOf(vllm0_).pinned_bytes, 0u);
}

TEST_F(CacheIndexEngineTest, EnginePagesAreCappedPerEngineAcrossItsTiers) {
  Reset({.max_engine_pages_per_engine = 5, .max_engine_pages_per_tenant = 100});
  Store({1, 2, 3}, vllm0_);
  Store({1, 2}, vllm0_cpu_);  // 5 page-locations in all
  EXPECT_EQ(Store({1, 2, 3}, vllm0_), 0u) << "pages the pool holds add nothing";
  const size_t events = events_.size();
  absl::StatusOr<uint64_t> more = index_->StoreEnginePages(ns_, Chain({1, 2, 3, 4}), vllm0_);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(more.status().message(), HasSubstr("max_engine_pages_per_engine: engine vllm-0"));
  EXPECT_EQ(PoolOf(vllm0_).pages, 3u) << "nothing stored";
  EXPECT_EQ(Cached({1, 2, 3, 4}), 3u);
  EXPECT_EQ(events_.size(), events) << "no event for a refused store";
  // Another engine has its own cap; removing pages makes room again.
  const PoolKey vllm1{"vllm-1", Tier::kGpu};
  EXPECT_EQ(Store({1, 2, 3, 4, 5}, vllm1), 5u);
  EXPECT_EQ(Remove({1, 2, 3}, vllm0_), 1u);
  EXPECT_EQ(Store({1, 2, 7}, vllm0_), 1u);
  EXPECT_TRUE(index_->CheckTenantAccounting().ok());
}

TEST_F(CacheIndexEngineTest, EnginePagesAreCappedPerTenantAndFreedWithTheirPools) {
  Reset({.max_engine_pages_per_engine = 100, .max_engine_pages_per_tenant = 6});
  const NamespaceId other_ns{"acme", "other"};
  ASSERT_TRUE(index_->RegisterModel(other_ns, Mla()).ok());
  const NamespaceId globex{"globex", "deepseek-v3"};
  ASSERT_TRUE(index_->RegisterModel(globex, Mla()).ok());
  Store({1, 2, 3, 4}, {"vllm-1", Tier::kGpu});
  // acme's other namespace and engine count against the same tenant cap.
  const std::vector<PageHash> chain = *index_->HashTokens(other_ns, std::vector<int32_t>(12, 5));
  absl::StatusOr<uint64_t> over = index_->StoreEnginePages(other_ns, chain, {"vllm-2", Tier::kGpu});
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("max_engine_pages_per_tenant: the engines of "
                                                 "tenant acme hold 4 of its 6"));
  ASSERT_TRUE(
      index_->StoreEnginePages(other_ns, std::span(chain).first(2), {"vllm-2", Tier::kGpu}).ok());
  // Another tenant's engines are not held back by acme's.
  const std::vector<PageHash> theirs = *index_->HashTokens(globex, std::vector<int32_t>(24, 9));
  ASSERT_TRUE(index_->StoreEnginePages(globex, theirs, {"vllm-3", Tier::kGpu}).ok());
  IndexStats stats = index_->Stats();
  ASSERT_EQ(stats.tenants.size(), 2u);
  EXPECT_EQ(stats.tenants[0].engine_pages, 6u);
  EXPECT_EQ(stats.tenants[1].engine_pages, 6u);
  EXPECT_EQ(stats.max_engine_pages_per_tenant, 6u);
  // Clearing a pool (what a session's end does) gives its pages back to the tenant.
  ASSERT_TRUE(index_->ClearEnginePool(ns_, {"vllm-1", Tier::kGpu}).ok());
  EXPECT_EQ(index_->Stats().tenants[0].engine_pages, 2u);
  EXPECT_EQ(index_->Stats().namespaces[0].radix_nodes + index_->Stats().namespaces[1].radix_nodes,
            1u)
      << "the cleared chain's nodes are freed; other's 2-page chain is one node";
  EXPECT_TRUE(index_->CheckTenantAccounting().ok());
}

TEST_F(CacheIndexEngineTest, UnknownNamespaceAndEmptyChainsAreRefused) {
  const NamespaceId other{"acme", "other"};
  EXPECT_EQ(index_->StoreEnginePages(other, Chain({1}), vllm0_).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(index_->StoreEnginePages(ns_, {}, vllm0_).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->RemoveEnginePages(ns_, {}, vllm0_).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index_->PoolPages(vllm0_), 0u);
}

// What an engine holds, as a set of page chains closed under prefixes: the model the
// index must agree with after any mix of stores, removals, pins and releases.
TEST_F(CacheIndexEngineTest, RandomizedAgreesWithAModelOfTheEngine) {
  std::mt19937 rng(20261125);
  ASSERT_TRUE(index_->SetPoolCapacity(gpu0_, 12 * bpp_).ok());
  // A universe of chains from a small tree of page ids (branching on a few values).
  auto random_chain = [&] {
    std::vector<int32_t> ids(1 + rng() % 6);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 3);
    return ids;
  };
  std::set<std::vector<int32_t>> held;  // every held chain, prefix-closed
  std::vector<PinId> pins;
  for (int step = 0; step < 3000; ++step) {
    std::vector<int32_t> chain = random_chain();
    switch (rng() % 6) {
      case 0:
      case 1: {
        Store(chain, vllm0_);
        for (size_t k = 1; k <= chain.size(); ++k) held.insert({chain.begin(), chain.begin() + k});
        break;
      }
      case 2: {
        Remove(chain, vllm0_);
        if (held.count(chain) > 0) {
          std::erase_if(held, [&](const std::vector<int32_t>& h) {
            return h.size() >= chain.size() && std::equal(chain.begin(), chain.end(), h.begin());
          });
        }
        break;
      }
      case 3: {
        std::vector<PageHash> pages = Chain(chain);
        std::vector<BlockId> blocks(pages.size());
        for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<BlockId>(rng());
        (void)index_->Insert(ns_, pages, gpu0_, blocks);  // may be refused when pinned full
        break;
      }
      case 4: {
        absl::StatusOr<MatchResult> m = index_->Match(ns_, Chain(chain), {.pin = true});
        ASSERT_TRUE(m.ok()) << m.status();
        if (m->pin_id != 0) pins.push_back(m->pin_id);
        break;
      }
      case 5: {
        if (pins.empty()) break;
        const size_t i = rng() % pins.size();
        ASSERT_TRUE(index_->Release(ns_, pins[i]).ok());
        pins.erase(pins.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
    if (step % 50 == 0) {
      ASSERT_EQ(index_->PoolPages(vllm0_), held.size()) << "step " << step;
      // Every held chain is matched whole, in the engine's pool.
      for (const std::vector<int32_t>& h : held) {
        absl::StatusOr<MatchResult> m = Probe(h);
        ASSERT_TRUE(m.ok());
        ASSERT_EQ(m->matched_pages, h.size()) << "step " << step;
        bool in_engine = false;
        for (const auto& r : ReplicasOf(*m, m->segments.back())) in_engine |= *r.pool == vllm0_;
        ASSERT_TRUE(in_engine) << "step " << step;
      }
      ASSERT_TRUE(index_->CheckTenantAccounting().ok());
    }
  }
  for (PinId pin : pins) ASSERT_TRUE(index_->Release(ns_, pin).ok());
  ASSERT_TRUE(index_->ClearEnginePool(ns_, vllm0_).ok());
  ASSERT_TRUE(index_->EvictFromNamespace(ns_, PoolOf(gpu0_).used_bytes).ok() ||
              PoolOf(gpu0_).used_bytes == 0);
  EXPECT_EQ(index_->Stats().namespaces[0].radix_nodes, 0u);
  EXPECT_EQ(PoolOf(vllm0_).pinned_bytes, 0u);
}

}  // namespace
}  // namespace kvcm
