// One kvcm-manager and three kvcm-agents as processes (host pools, TCP transport) driven by
// the worker simulator (tests/util/worker_sim.h), as an engine's workers would drive them:
//   - a prefix computed on the agent Route picked is fetched by another when that one is the
//     only candidate or the first has a long queue; the copy reads back byte for byte, and
//     RunAttention over it gives exactly the original's output;
//   - a few hundred requests over prompts sharing prefixes: afterwards every allocated block
//     of every agent is indexed, no block holds two pages, every replica holds its page;
//   - kvcmctl fetch moves a prompt between agents, and refuses with a reason and exit 1 when
//     nothing is cached, the destination holds it already, or an agent is unknown;
//   - kill -9 of the source mid-fetch: the destination frees what it allocated, indexes
//     nothing; kill -9 of the destination mid-fetch: the source's pages stay, in the same
//     blocks, and a third agent still fetches them.
// A small MLA geometry (4 layers, 144 KiB pages) keeps it to seconds on two cores.

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "tests/util/block_agent_calls.h"
#include "tests/util/process_cluster.h"
#include "tests/util/worker_sim.h"

namespace kvcm {
namespace {

using ::kvcm::testing::OutputField;
using ::kvcm::testing::ProcessCluster;
using ::kvcm::testing::ProcessResult;
using ::kvcm::testing::Subprocess;
using ::kvcm::testing::WaitUntil;
using ::kvcm::testing::WorkerSim;

constexpr uint32_t kPageTokens = 32;
constexpr uint32_t kLayers = 4;
constexpr uint64_t kPageBytes = (512 + 64) * 2 * kLayers * kPageTokens;  // 144 KiB
constexpr uint64_t kAgentBlocks = 1024;
constexpr uint32_t kHeads = 16;
const NamespaceId kNs{"acme", "mla-small"};
const std::vector<std::string> kAgents = {"gpu-a", "gpu-b", "gpu-c"};

ModelSpec SmallMla() {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = kLayers,
                   .num_heads = kHeads,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .dtype = KvDtype::kBf16,
                   .page_size_tokens = kPageTokens};
}

// `n` tokens of the sequence `seed`: two prompts share exactly the prefix their seeds share.
std::vector<int32_t> Tokens(int seed, size_t n, size_t from = 0) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((from + i) * 7919 + seed * 104729);
  return t;
}

std::vector<RouteParams::Candidate> Only(const std::string& agent,
                                         uint64_t queued_prefill_tokens = 0) {
  return {{.agent_id = agent, .queued_prefill_tokens = queued_prefill_tokens}};
}

class ClusterProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cluster_ = ProcessCluster::Start(
        {.agent_ids = kAgents,
         .agent_flags = {"--model=", "--attention=mla", absl::StrCat("--num_layers=", kLayers),
                         absl::StrCat("--num_heads=", kHeads), "--kv_lora_rank=512",
                         "--rope_dim=64", "--kv_dtype=bf16",
                         absl::StrCat("--page_size_tokens=", kPageTokens),
                         absl::StrCat("--capacity_bytes=", kAgentBlocks * kPageBytes),
                         "--heartbeat_interval_ms=100", "--use_device=false"},
         // A killed agent's replicas leave Match within 2 s.
         .manager_flags = {"--agent_heartbeat_timeout_ms=2000"}});
    ASSERT_NE(cluster_, nullptr);
    std::vector<WorkerSim::AgentInfo> infos;
    for (const std::string& id : kAgents) {
      const ManagerStats::Agent& a = cluster_->agent(id);
      infos.push_back({id, a.block_agent_address});
    }
    absl::StatusOr<std::unique_ptr<WorkerSim>> sim =
        WorkerSim::Create(&cluster_->client(), kNs, SmallMla(), std::move(infos));
    ASSERT_TRUE(sim.ok()) << sim.status();
    sim_ = *std::move(sim);
  }

  Client& client() { return cluster_->client(); }

  std::vector<PageHash> Pages(const std::vector<int32_t>& tokens) {
    absl::StatusOr<std::vector<PageHash>> pages = client().HashPrompt(kNs, tokens);
    EXPECT_TRUE(pages.ok()) << pages.status();
    return pages.ok() ? *pages : std::vector<PageHash>{};
  }

  // What any replica of pages [first, first + n) must hold.
  std::string Expected(const std::vector<PageHash>& pages, size_t first, size_t n) {
    return sim_->ExpectedBytes(pages, first, n);
  }

  // What `agent` holds in `blocks` (committed in its epoch).
  std::string Read(const std::string& agent, const std::vector<BlockId>& blocks) {
    absl::StatusOr<std::string> bytes = sim_->ReadBlocks(agent, blocks);
    EXPECT_TRUE(bytes.ok()) << agent << ": " << bytes.status();
    return bytes.ok() ? *bytes : "";
  }

  // RunAttention over the first `seq_len` tokens held in `blocks` on `agent`, layer 1: the
  // raw fp32 output bytes and the log-sum-exps.
  std::pair<std::string, std::vector<float>> Attention(const std::string& agent,
                                                       const std::vector<BlockId>& blocks,
                                                       uint32_t seq_len) {
    v1::RunAttentionRequest req;
    req.add_block_table()->mutable_block_ids()->Add(blocks.begin(), blocks.end());
    req.add_seq_lens(seq_len);
    std::string query(kHeads * 576 * 2, '\0');
    for (size_t i = 0; i < query.size(); i += 2) {
      // bf16 of +-(1 + k/128) / 8: a spread of finite values.
      const uint16_t bits = static_cast<uint16_t>(((i / 2) % 3 == 0 ? 0x8000 : 0) | (124 << 7) |
                                                  ((i * 37 / 2) & 0x7f));
      query[i] = static_cast<char>(bits & 0xff);
      query[i + 1] = static_cast<char>(bits >> 8);
    }
    req.set_query(query);
    req.set_softmax_scale(0.0721688f);  // 1 / sqrt(192)
    req.set_num_heads(kHeads);
    req.set_layer(1);
    req.set_owner_epoch(sim_->epoch(agent));
    v1::RunAttentionResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    const grpc::Status s = sim_->stub(agent).RunAttention(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << agent << ": " << s.error_message();
    return {resp.output(), {resp.lse().begin(), resp.lse().end()}};
  }

  // Blocks of `agent` not free, and pages the index holds in its pool.
  uint64_t Allocated(const std::string& agent) {
    absl::StatusOr<v1::BlockAgentStatsResponse> s = cluster_->AgentStats(agent);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->geometry().num_blocks() - s->free_blocks() : 0;
  }
  uint64_t Indexed(const std::string& agent) {
    absl::StatusOr<ManagerStats> stats = client().Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    uint64_t pages = 0;
    if (!stats.ok()) return pages;
    for (const ManagerStats::Pool& p : stats->pools) {
      if (p.pool.agent_id == agent) pages += p.pages;
    }
    return pages;
  }

  // Starts serving `tokens` on `dest` alone (it fetches them) on another thread and returns
  // once `dest` has allocated the fetch's blocks: the pull is under way (or already over).
  std::future<absl::StatusOr<WorkerSim::Served>> StartFetch(const std::vector<int32_t>& tokens,
                                                            const std::string& dest) {
    const uint64_t free_before = cluster_->FreeBlocks(dest);
    auto fetch = std::async(std::launch::async,
                            [this, &tokens, dest] { return sim_->Serve(tokens, Only(dest)); });
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (cluster_->FreeBlocks(dest) == free_before && absl::Now() < give_up &&
           fetch.wait_for(std::chrono::milliseconds(0)) != std::future_status::ready) {
      absl::SleepFor(absl::Microseconds(500));
    }
    return fetch;
  }

  ProcessResult Ctl(std::vector<std::string> args) {
    args.insert(args.begin(), {KVCMCTL_PATH, "--insecure",
                               absl::StrCat("--manager_address=", cluster_->manager_address())});
    std::unique_ptr<Subprocess> p = Subprocess::Start(args);
    return p == nullptr ? ProcessResult{} : p->Finish(absl::Seconds(30));
  }

  std::unique_ptr<ProcessCluster> cluster_;
  std::unique_ptr<WorkerSim> sim_;
};

TEST_F(ClusterProcessTest, APrefixComputedOnOneAgentIsFetchedByAnotherBitForBit) {
  const std::vector<int32_t> tokens = Tokens(1, 6 * kPageTokens + 7);
  const std::vector<PageHash> pages = Pages(tokens);
  std::vector<RouteParams::Candidate> all;
  for (const std::string& id : kAgents) all.push_back({.agent_id = id});
  absl::StatusOr<WorkerSim::Served> first = sim_->Serve(tokens, all);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->computed_pages, 6u);
  const std::string a = first->agent;

  // A has a long queue: Route sends the prompt elsewhere, and that agent fetches it from A.
  for (RouteParams::Candidate& c : all) {
    if (c.agent_id == a) c.queued_prefill_tokens = 1'000'000;
  }
  absl::StatusOr<WorkerSim::Served> second = sim_->Serve(tokens, all);
  ASSERT_TRUE(second.ok()) << second.status();
  const std::string b = second->agent;
  ASSERT_NE(b, a);
  EXPECT_EQ(second->fetched_pages, 6u);
  EXPECT_EQ(second->cached_pages + second->computed_pages, 0u);

  // Match from B: B's replica first, local, and A's still there.
  absl::StatusOr<MatchReply> m = client().Match(kNs, tokens, {.requester_agent_id = b});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->local_pages, 6u);
  ASSERT_EQ(m->segments.size(), 1u);
  ASSERT_EQ(m->segments[0].replicas.size(), 2u);
  EXPECT_EQ(m->segments[0].replicas[0].pool.agent_id, b);
  EXPECT_EQ(m->segments[0].replicas[0].block_ids, second->block_ids);
  EXPECT_EQ(m->segments[0].replicas[1].pool.agent_id, a);
  EXPECT_EQ(m->segments[0].replicas[1].block_ids, first->block_ids);

  // Both copies read back as the pages' bytes, and attention over them is identical.
  const std::string want = Expected(pages, 0, 6);
  EXPECT_TRUE(Read(a, first->block_ids) == want) << "A's copy differs from what was written";
  EXPECT_TRUE(Read(b, second->block_ids) == want) << "B's copy differs from A's";
  const uint32_t seq_len = static_cast<uint32_t>(6 * kPageTokens - 5);
  const auto [out_a, lse_a] = Attention(a, first->block_ids, seq_len);
  const auto [out_b, lse_b] = Attention(b, second->block_ids, seq_len);
  ASSERT_EQ(out_a.size(), kHeads * 512 * sizeof(float));
  EXPECT_TRUE(out_a == out_b) << "attention over B's copy differs from A's";
  EXPECT_EQ(lse_a, lse_b);
  EXPECT_NE(out_a, std::string(out_a.size(), '\0'));

  // Another prompt computed on A, then served on C alone: C fetches it.
  const std::vector<int32_t> other = Tokens(2, 3 * kPageTokens);
  absl::StatusOr<WorkerSim::Served> on_a = sim_->Serve(other, Only(a));
  ASSERT_TRUE(on_a.ok()) << on_a.status();
  std::string c;
  for (const std::string& id : kAgents) {
    if (id != a && id != b) c = id;
  }
  absl::StatusOr<WorkerSim::Served> on_c = sim_->Serve(other, Only(c));
  ASSERT_TRUE(on_c.ok()) << on_c.status();
  EXPECT_EQ(on_c->fetched_pages, 3u);
  EXPECT_TRUE(Read(c, on_c->block_ids) == Expected(Pages(other), 0, 3));
}

TEST_F(ClusterProcessTest, KvcmctlFetchMovesAPromptOrSaysWhyNot) {
  const std::vector<std::string> prompt = {"--tenant=acme", "--model=mla-small",
                                           "--random_tokens=100", "--seed=3"};  // 3 pages
  auto fetch = [&](std::vector<std::string> flags) {
    std::vector<std::string> args = {"fetch"};
    args.insert(args.end(), prompt.begin(), prompt.end());
    args.insert(args.end(), flags.begin(), flags.end());
    return Ctl(args);
  };
  ProcessResult r = fetch({"--agent=gpu-b"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_NE(r.err.find("NOT_FOUND: nothing of the prompt is cached"), std::string::npos) << r.err;

  std::vector<std::string> insert = {"insert", "--agent=gpu-a"};
  insert.insert(insert.end(), prompt.begin(), prompt.end());
  r = Ctl(insert);
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  const std::string on_a = OutputField(r.out, "block_ids");

  r = fetch({"--agent=gpu-b", "--from=gpu-a"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_EQ(OutputField(r.out, "fetched_pages"), "3");
  EXPECT_NE(r.out.find(absl::StrCat("from gpu-a:gpu pages [0, 3) blocks ", on_a)),
            std::string::npos)
      << r.out;
  r = Ctl({"match", "--agent=gpu-b", prompt[0], prompt[1], prompt[2], prompt[3]});
  EXPECT_EQ(OutputField(r.out, "local_pages"), "3") << r.Describe();
  EXPECT_NE(r.out.find(absl::StrCat("  gpu-a:gpu blocks ", on_a)), std::string::npos) << r.out;

  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--agent=gpu-b"}, "ALREADY_EXISTS: gpu-b:gpu already holds 3 matched pages"},
      {{"--agent=gpu-c", "--from=gpu-c"}, "--from must name another agent"},
      {{"--agent=gpu-9"}, "NOT_FOUND: agent gpu-9 is not registered"},
      {{"--agent=gpu-c", "--from=gpu-9"}, "NOT_FOUND: agent gpu-9 is not registered"},
      {{"--agent=gpu-a", "--from=gpu-c"}, "ALREADY_EXISTS"},
  };
  for (const auto& [flags, message] : refused) {
    r = fetch(flags);
    EXPECT_EQ(r.exit_code, message.starts_with("--") ? 2 : 1) << message << "\n" << r.Describe();
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }
  EXPECT_EQ(Allocated("gpu-b"), Indexed("gpu-b"));
}

TEST_F(ClusterProcessTest, HundredsOfRequestsLeaveEveryBlockIndexedOrFree) {
  // 36 conversations of 5 pages and 31 tokens: 6 shared system prompts of 3 pages, then 2
  // pages of their own. Each request is a conversation's first 3 to 5 pages and a partial page.
  constexpr int kConversations = 36;
  constexpr int kRequests = 300;
  std::vector<std::vector<int32_t>> conversations;
  for (int k = 0; k < kConversations; ++k) {
    std::vector<int32_t> t = Tokens(100 + k % 6, 3 * kPageTokens);
    const std::vector<int32_t> own = Tokens(200 + k, 2 * kPageTokens + 31, t.size());
    t.insert(t.end(), own.begin(), own.end());
    conversations.push_back(std::move(t));
  }
  std::mt19937 rng(7);
  std::map<std::string, int> served_on;
  uint64_t cached = 0, fetched = 0, computed = 0;
  const absl::Time start = absl::Now();
  for (int r = 0; r < kRequests; ++r) {
    const std::vector<int32_t>& conv = conversations[rng() % kConversations];
    const size_t n = (3 + rng() % 3) * kPageTokens + rng() % kPageTokens;
    const std::vector<int32_t> prompt(conv.begin(), conv.begin() + std::min(n, conv.size()));
    absl::StatusOr<WorkerSim::Served> s = sim_->Serve(prompt);
    ASSERT_TRUE(s.ok()) << "request " << r << ": " << s.status();
    ++served_on[s->agent];
    cached += s->cached_pages;
    fetched += s->fetched_pages;
    computed += s->computed_pages;
  }
  std::printf("%d requests in %.1f s: pages cached %lu, fetched %lu, computed %lu; per agent",
              kRequests, absl::ToDoubleSeconds(absl::Now() - start), cached, fetched, computed);
  for (const auto& [agent, n] : served_on) std::printf(" %s=%d", agent.c_str(), n);
  std::printf("\n");
  EXPECT_EQ(served_on.size(), 3u) << "the queues should spread the requests";
  EXPECT_GT(fetched, 0u);
  EXPECT_GT(cached, computed);

  // Every allocated block is indexed, on every agent.
  for (const std::string& agent : kAgents) {
    EXPECT_EQ(Allocated(agent), Indexed(agent)) << agent << ": allocated blocks vs indexed pages";
    EXPECT_GT(Indexed(agent), 0u) << agent;
  }
  // Every replica of every page holds that page's bytes, and no block holds two pages.
  std::map<std::pair<std::string, BlockId>, PageHash> owner;
  for (const std::vector<int32_t>& conv : conversations) {
    const std::vector<PageHash> pages = Pages(conv);
    absl::StatusOr<MatchReply> m = client().Match(kNs, conv, {.probe = true});
    ASSERT_TRUE(m.ok()) << m.status();
    for (const MatchReply::Segment& seg : m->segments) {
      for (const MatchReply::Replica& rep : seg.replicas) {
        EXPECT_TRUE(Read(rep.pool.agent_id, rep.block_ids) ==
                    Expected(pages, seg.first_page, seg.num_pages))
            << rep.pool.ToString() << " pages [" << seg.first_page << ", "
            << seg.first_page + seg.num_pages << ")";
        for (uint32_t i = 0; i < seg.num_pages; ++i) {
          auto [it, inserted] = owner.emplace(std::pair(rep.pool.agent_id, rep.block_ids[i]),
                                              pages[seg.first_page + i]);
          EXPECT_EQ(it->second, pages[seg.first_page + i])
              << rep.pool.ToString() << " block " << rep.block_ids[i] << " holds two pages";
        }
      }
    }
  }
  uint64_t indexed = 0;
  for (const std::string& agent : kAgents) indexed += Indexed(agent);
  EXPECT_EQ(owner.size(), indexed) << "pages indexed that no conversation reaches";
}

TEST_F(ClusterProcessTest, KillingTheSourceMidFetchLeaksNothingOnTheDestination) {
  // 768 pages (108 MiB) on A, pulled by B.
  const std::vector<int32_t> tokens = Tokens(3, 768 * kPageTokens);
  absl::StatusOr<WorkerSim::Served> on_a = sim_->Serve(tokens, Only("gpu-a"));
  ASSERT_TRUE(on_a.ok()) << on_a.status();
  const uint64_t b_allocated = Allocated("gpu-b");
  auto fetch = StartFetch(tokens, "gpu-b");
  cluster_->Kill("gpu-a");
  const absl::StatusOr<WorkerSim::Served> served = fetch.get();
  std::printf("source killed: the fetch %s\n",
              served.ok() ? "had finished" : served.status().ToString().c_str());
  if (served.ok()) {
    // The pull won the race: B holds an indexed replica and nothing else.
    EXPECT_EQ(served->fetched_pages, 768u);
    EXPECT_EQ(Allocated("gpu-b"), b_allocated + 768);
  } else {
    EXPECT_TRUE(served.status().code() == absl::StatusCode::kUnavailable ||
                served.status().code() == absl::StatusCode::kDeadlineExceeded)
        << served.status();
    EXPECT_TRUE(WaitUntil([&] { return Allocated("gpu-b") == b_allocated; }, absl::Seconds(10)))
        << "B leaked blocks: " << Allocated("gpu-b") - b_allocated;
    EXPECT_TRUE(cluster_->MatchedOn(kNs, tokens, "gpu-b").empty());
  }
  EXPECT_EQ(Allocated("gpu-b"), Indexed("gpu-b"));
}

TEST_F(ClusterProcessTest, KillingTheDestinationMidFetchLeavesTheSourceServing) {
  const std::vector<int32_t> tokens = Tokens(4, 768 * kPageTokens);
  const std::vector<PageHash> pages = Pages(tokens);
  absl::StatusOr<WorkerSim::Served> on_a = sim_->Serve(tokens, Only("gpu-a"));
  ASSERT_TRUE(on_a.ok()) << on_a.status();
  auto fetch = StartFetch(tokens, "gpu-b");
  cluster_->Kill("gpu-b");
  const absl::StatusOr<WorkerSim::Served> served = fetch.get();
  std::printf("destination killed: the fetch %s\n",
              served.ok() ? "had finished" : served.status().ToString().c_str());
  // A is unaffected: the same blocks, every allocated one indexed.
  EXPECT_EQ(cluster_->MatchedOn(kNs, tokens, "gpu-a"), on_a->block_ids);
  EXPECT_EQ(Allocated("gpu-a"), Indexed("gpu-a"));
  // And it still serves them: C fetches the prompt from A, bit for bit (once B's replica,
  // if its fetch won the race, has left the index with B).
  EXPECT_TRUE(WaitUntil([&] { return cluster_->MatchedOn(kNs, tokens, "gpu-b").empty(); },
                        absl::Seconds(10)));
  absl::StatusOr<WorkerSim::Served> on_c = sim_->Serve(tokens, Only("gpu-c"));
  ASSERT_TRUE(on_c.ok()) << on_c.status();
  EXPECT_EQ(on_c->fetched_pages, 768u);
  EXPECT_TRUE(Read("gpu-c", on_c->block_ids) == Expected(pages, 0, 768));
  EXPECT_EQ(Allocated("gpu-c"), Indexed("gpu-c"));
}

}  // namespace
}  // namespace kvcm
