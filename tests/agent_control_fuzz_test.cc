// AgentControl under random and hostile input, in process: a ManagerServer with the cost
// policy (so evictions demote into HOST pools), a client inserting, matching, pinning and
// evicting at random, and fake agents driven by the test whose Commands streams ack at
// random: right and wrong sequences, error codes, commit acks naming all, some or foreign
// blocks, demote acks with too few, too many, repeated or pending block ids, acks never
// sent (the agent breaks the stream and reconnects), new epochs, registrations with bad
// fields. Every Insert waits for its CommitBlocks ack, so the agents answer on threads of
// their own and reconnect whenever a stream ends, as a real agent does. The manager must
// never crash, must answer every call with a documented code (an Insert's may also be
// one the agent gave its commit), and its byte accounting must stay exact throughout:
// every pool's used bytes are its pages x bytes per page, within capacity.
//
//   KVCM_FUZZ_SEED=<n> picks the seed (printed at the start); KVCM_FUZZ_STEPS=<n> the length.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "common/credentials.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "proto/core_types.h"
#include "server/service/manager_server.h"

namespace kvcm {
namespace {

constexpr uint64_t kBlocks = 24;  // per pool; the index's capacity is this many pages

ModelSpec Spec() {
  return ModelSpec{.attention = AttentionKind::kMla,
                   .num_layers = 27,
                   .num_heads = 16,
                   .kv_lora_rank = 512,
                   .rope_dim = 64,
                   .page_size_tokens = 16};
}

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::strtoull(v, nullptr, 10) : fallback;
}

// One fake agent: registers, and plays the agent's side of Commands on its own thread,
// acking whatever arrives at random. Like a real agent it opens a new stream (hello with its
// registered epoch) whenever one ends, until CloseStream.
class ChaosAgent {
 public:
  ChaosAgent(const std::string& address, std::string id, uint64_t seed)
      : id_(std::move(id)),
        control_(v1::AgentControl::NewStub(MakeInsecureChannel(address))),
        rng_(seed) {}
  ~ChaosAgent() { CloseStream(); }

  const std::string& id() const { return id_; }
  uint64_t epoch() const { return epoch_.load(); }

  grpc::Status Register(uint64_t epoch) {
    const uint64_t page = Spec().BytesPerPage();
    v1::RegisterAgentRequest req;
    req.set_agent_id(id_);
    req.set_device("host");
    req.set_tier(v1::TIER_GPU);
    ModelSpecToProto(Spec(), req.mutable_geometry()->mutable_spec());
    req.mutable_geometry()->set_bytes_per_block(page);
    req.mutable_geometry()->set_num_blocks(kBlocks);
    req.set_capacity_bytes(kBlocks * page);
    req.mutable_host_pool()->set_num_blocks(kBlocks);
    req.mutable_host_pool()->set_capacity_bytes(kBlocks * page);
    req.set_epoch(epoch);
    grpc::ClientContext ctx;
    v1::RegisterAgentResponse resp;
    grpc::Status s = control_->Register(&ctx, req, &resp);
    if (s.ok()) epoch_ = epoch;
    return s;
  }

  grpc::Status Heartbeat(uint64_t epoch) {
    v1::HeartbeatRequest req;
    req.set_agent_id(id_);
    req.set_epoch(epoch);
    grpc::ClientContext ctx;
    v1::HeartbeatResponse resp;
    return control_->Heartbeat(&ctx, req, &resp);
  }

  // Starts the agent's Commands thread; its first stream's hello names `hello_epoch`
  // (possibly a bad one), every later one the registered epoch.
  void OpenStream(uint64_t hello_epoch) {
    CloseStream();
    {
      absl::MutexLock lock(&mu_);
      stop_ = false;
    }
    thread_ = std::thread([this, hello_epoch, seed = rng_()] { Run(hello_epoch, seed); });
  }

  // Cancels the open stream, if any, and joins the thread.
  void CloseStream() {
    if (!thread_.joinable()) return;
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      if (ctx_ != nullptr) ctx_->TryCancel();
    }
    thread_.join();
  }

  uint64_t commands_seen() const { return commands_seen_.load(); }
  uint64_t commits_seen() const { return commits_seen_.load(); }
  uint64_t streams() const { return streams_.load(); }
  // The codes of the commit acks sent since the last call, as a bit mask (bit c: code c).
  uint32_t TakeCommitCodes() { return commit_codes_.exchange(0); }

 private:
  void Run(uint64_t hello_epoch, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (uint64_t epoch = hello_epoch;; epoch = epoch_.load()) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
        ctx_ = &ctx;
      }
      std::unique_ptr<grpc::ClientReaderWriter<v1::AgentCommandAck, v1::AgentCommand>> stream =
          control_->Commands(&ctx);
      v1::AgentCommandAck hello;
      hello.set_agent_id(id_);
      hello.set_epoch(epoch);
      if (stream->Write(hello)) AckLoop(*stream, ctx, rng);
      // Finish waits for every message the manager sent to be read.
      v1::AgentCommand unread;
      while (stream->Read(&unread)) {
      }
      const grpc::Status s = stream->Finish();
      {
        absl::MutexLock lock(&mu_);
        ctx_ = nullptr;
      }
      ++streams_;
      // The final status must be one the Commands RPC documents.
      const grpc::StatusCode code = s.error_code();
      EXPECT_TRUE(code == grpc::StatusCode::OK || code == grpc::StatusCode::CANCELLED ||
                  code == grpc::StatusCode::ABORTED || code == grpc::StatusCode::NOT_FOUND ||
                  code == grpc::StatusCode::INVALID_ARGUMENT ||
                  code == grpc::StatusCode::UNAVAILABLE)
          << id_ << ": Commands ended with " << code << " " << s.error_message();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // then reconnect
    }
  }

  void AckLoop(grpc::ClientReaderWriter<v1::AgentCommandAck, v1::AgentCommand>& stream,
               grpc::ClientContext& ctx, std::mt19937_64& rng) {
    v1::AgentCommand command;
    while (stream.Read(&command)) {
      ++commands_seen_;
      const uint32_t dice = rng() % 40;
      if (dice == 0) {  // silent: the stream breaks before the ack, the command is resent
        ctx.TryCancel();
        continue;
      }
      v1::AgentCommandAck ack;
      ack.set_sequence(command.sequence());
      if (dice == 1 || dice == 2) {
        // A future sequence (the manager ends the stream), or an old one (ignored, then
        // the right ack follows).
        v1::AgentCommandAck wrong;
        wrong.set_sequence(dice == 1
                               ? command.sequence() + 1 + rng() % 3
                               : command.sequence() - std::min<uint64_t>(command.sequence(), 1));
        if (!stream.Write(wrong)) break;
      }
      if (rng() % 6 == 0) {
        ack.set_code(static_cast<int32_t>(1 + rng() % 16));
        ack.set_message("chaos");
      }
      if (command.has_demote()) {
        const int n = command.demote().source_block_ids_size();
        int count = n;
        if (rng() % 8 == 0) count = static_cast<int>(rng() % (n + 3));  // wrong count
        for (int i = 0; i < count; ++i) {
          const uint32_t pick = rng() % 10;
          ack.add_block_ids(pick == 0   ? kPendingBlock
                            : pick == 1 ? 0  // repeated ids
                                        : static_cast<BlockId>(rng() % kBlocks));
        }
      } else if (command.has_commit()) {
        // Mostly every block as newly committed; sometimes a subset, or ids the command
        // did not name (repeated, pending, past the pool).
        ++commits_seen_;
        commit_codes_ |= uint32_t{1} << ack.code();
        const auto& ids = command.commit().block_ids();
        const uint32_t pick = rng() % 8;
        for (const BlockId id : ids) {
          if (pick < 6 || (pick == 6 && rng() % 2 == 0)) ack.add_block_ids(id);
        }
        if (pick == 7) {
          for (uint32_t i = 0, n = rng() % 4; i < n; ++i) {
            const uint32_t what = rng() % 4;
            ack.add_block_ids(what == 0   ? kPendingBlock
                              : what == 1 ? static_cast<BlockId>(kBlocks + rng() % 4)
                                          : static_cast<BlockId>(rng() % kBlocks));
          }
        }
      }
      if (rng() % 40 == 0) ack.set_agent_id("spoofed");  // ignored after the hello
      if (!stream.Write(ack)) break;
    }
  }

  const std::string id_;
  std::unique_ptr<v1::AgentControl::Stub> control_;
  std::mt19937_64 rng_;  // the test thread's
  std::atomic<uint64_t> epoch_{0};
  std::thread thread_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* ctx_ ABSL_GUARDED_BY(mu_) = nullptr;  // the open stream's
  std::atomic<uint64_t> commands_seen_{0};
  std::atomic<uint64_t> commits_seen_{0};
  std::atomic<uint64_t> streams_{0};
  std::atomic<uint32_t> commit_codes_{0};
};

// Every pool's bytes add up; what a failed call must not break.
void ExpectConsistent(CacheIndex& index, const std::string& where) {
  const IndexStats s = index.Stats();
  const uint64_t page = Spec().BytesPerPage();
  for (const PoolStats& p : s.pools) {
    ASSERT_EQ(p.used_bytes, p.pages * page) << where << " " << p.pool.ToString();
    ASSERT_LE(p.used_bytes, p.capacity_bytes) << where << " " << p.pool.ToString();
    ASSERT_LE(p.pinned_bytes, p.used_bytes) << where << " " << p.pool.ToString();
  }
}

TEST(AgentControlFuzzTest, RandomAcksAndRegistrationsNeverBreakTheManager) {
  const uint64_t seed = EnvOr("KVCM_FUZZ_SEED", 20261122);
  const uint64_t steps = EnvOr("KVCM_FUZZ_STEPS", 1500);
  std::printf("KVCM_FUZZ_SEED=%llu KVCM_FUZZ_STEPS=%llu\n", static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(steps));
  SCOPED_TRACE(::testing::Message() << "KVCM_FUZZ_SEED=" << seed);
  std::mt19937_64 rng(seed);

  ServerOptions o;
  o.tls.insecure = true;
  o.listen_address = "127.0.0.1:0";
  o.metrics_address = "";
  o.shutdown_grace_ms = 100;
  o.policy = "cost";
  o.lease_sweep_interval_ms = 5;
  o.agent_heartbeat_timeout_ms = 60'000;
  absl::StatusOr<std::unique_ptr<ManagerServer>> started = ManagerServer::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  ManagerServer& manager = **started;

  ClientOptions co;
  co.insecure = true;
  co.address = manager.address();
  absl::StatusOr<std::unique_ptr<Client>> connected = Client::Connect(co);
  ASSERT_TRUE(connected.ok()) << connected.status();
  Client& client = **connected;
  const NamespaceId ns{"fuzz", "v2-lite"};
  ASSERT_TRUE(client.RegisterModel(ns, Spec()).ok());

  std::vector<std::unique_ptr<ChaosAgent>> agents;
  for (int i = 0; i < 2; ++i) {
    agents.push_back(
        std::make_unique<ChaosAgent>(manager.address(), "chaos-" + std::to_string(i), rng()));
    ASSERT_TRUE(agents.back()->Register(1).ok());
    agents.back()->OpenStream(1);
  }

  // Insert answers by code. An insert waits for its commit's ack (and a release's), which
  // the agents always send in the end, reconnecting whenever a stream breaks: an insert
  // past its deadline means the manager lost a command or an answer.
  std::map<absl::StatusCode, uint64_t> inserts;
  std::vector<uint64_t> pins;
  for (uint64_t step = 0; step < steps; ++step) {
    ChaosAgent& agent = *agents[rng() % agents.size()];
    const PoolRef gpu{agent.id(), Tier::kGpu};
    // Prompts of 1..6 pages over a 3-token alphabet: heavy prefix sharing.
    std::vector<int32_t> tokens(Spec().page_size_tokens * (1 + rng() % 6));
    for (size_t i = 0; i < tokens.size(); i += Spec().page_size_tokens) {
      std::fill_n(tokens.begin() + i, Spec().page_size_tokens, static_cast<int32_t>(rng() % 3));
    }
    const uint32_t pages = static_cast<uint32_t>(tokens.size() / Spec().page_size_tokens);
    const uint32_t op = rng() % 100;
    if (op < 35) {
      // Distinct blocks of the pool, or now and then one named twice, which the manager
      // refuses before asking the agent.
      std::vector<BlockId> blocks(kBlocks);
      std::iota(blocks.begin(), blocks.end(), BlockId{0});
      std::shuffle(blocks.begin(), blocks.end(), rng);
      blocks.resize(pages);
      const bool repeated = pages > 1 && rng() % 10 == 0;
      if (repeated) blocks[pages - 1] = blocks[0];
      (void)agent.TakeCommitCodes();
      absl::StatusOr<InsertReply> r = client.Insert(ns, tokens, gpu, blocks);
      const absl::StatusCode code = r.status().code();
      ++inserts[code];
      if (repeated) {
        ASSERT_EQ(code, absl::StatusCode::kInvalidArgument) << r.status();
      } else {
        // The index's and the inserter's own answers, or a code the agent gave a commit.
        const uint32_t agent_codes = agent.TakeCommitCodes();
        ASSERT_TRUE(r.ok() || code == absl::StatusCode::kResourceExhausted ||
                    code == absl::StatusCode::kFailedPrecondition ||
                    code == absl::StatusCode::kAborted || code == absl::StatusCode::kUnavailable ||
                    (agent_codes & (uint32_t{1} << static_cast<int>(code))) != 0)
            << r.status() << " (codes the agent acked commits with: 0x" << std::hex << agent_codes
            << std::dec << ")";
      }
    } else if (op < 55) {
      absl::StatusOr<MatchReply> m =
          client.Match(ns, tokens, {.requester_agent_id = agent.id(), .pin = rng() % 3 == 0});
      ASSERT_TRUE(m.ok()) << m.status();
      if (m->pin_id != 0) pins.push_back(m->pin_id);
    } else if (op < 62) {
      if (!pins.empty()) {
        const absl::Status s = client.Release(ns, pins.back());
        ASSERT_TRUE(s.ok() || s.code() == absl::StatusCode::kAborted) << s;
        pins.pop_back();
      }
    } else if (op < 75) {
      const PoolRef pool{agent.id(), rng() % 3 == 0 ? Tier::kHost : Tier::kGpu};
      absl::StatusOr<EvictReply> r =
          client.EvictFromPool(pool, 1 + rng() % (4 * Spec().BytesPerPage()));
      ASSERT_TRUE(r.ok() || r.status().code() == absl::StatusCode::kOutOfRange ||
                  r.status().code() == absl::StatusCode::kResourceExhausted)
          << r.status();
    } else if (op < 80) {
      agent.CloseStream();
      agent.OpenStream(rng() % 8 == 0 ? agent.epoch() + 7 : agent.epoch());  // some bad hellos
    } else if (op < 83) {
      const uint64_t epoch = agent.epoch() + 1;  // a restart: its pages and queue go
      ASSERT_TRUE(agent.Register(epoch).ok());
      agent.OpenStream(epoch);
    } else if (op < 88) {
      // Stale, unknown or current epochs.
      const grpc::Status s = agent.Heartbeat(rng() % 2 == 0 ? agent.epoch() : rng() % 5);
      const grpc::StatusCode code = s.error_code();
      ASSERT_TRUE(code == grpc::StatusCode::OK || code == grpc::StatusCode::ABORTED ||
                  code == grpc::StatusCode::INVALID_ARGUMENT)
          << s.error_message();
    } else if (op < 93) {
      // A registration with one bad field changes nothing.
      const IndexStats before = manager.index().Stats();
      v1::RegisterAgentRequest bad;
      bad.set_agent_id(rng() % 2 == 0 ? "bad id!" : agent.id());
      bad.set_tier(static_cast<v1::Tier>(rng() % 6));
      bad.mutable_geometry()->set_num_blocks(rng() % 3);
      bad.set_capacity_bytes(rng() % 2 == 0 ? 0 : ~uint64_t{0});
      bad.set_epoch(rng() % 2);
      grpc::ClientContext ctx;
      v1::RegisterAgentResponse resp;
      auto stub = v1::AgentControl::NewStub(MakeInsecureChannel(manager.address()));
      const grpc::Status s = stub->Register(&ctx, bad, &resp);
      ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      const IndexStats after = manager.index().Stats();
      ASSERT_EQ(before.pools.size(), after.pools.size());
      for (size_t i = 0; i < before.pools.size(); ++i) {
        ASSERT_EQ(before.pools[i].capacity_bytes, after.pools[i].capacity_bytes);
      }
    } else {
      // Let the acks catch up now and then.
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ExpectConsistent(manager.index(), "step " + std::to_string(step));
    if (::testing::Test::HasFatalFailure()) return;
  }

  uint64_t commands = 0;
  uint64_t commits = 0;
  uint64_t streams = 0;
  for (auto& a : agents) {
    a->CloseStream();
    commands += a->commands_seen();
    commits += a->commits_seen();
    streams += a->streams();
  }
  std::printf("commands %llu (commits %llu) over %llu streams; inserts by code:",
              static_cast<unsigned long long>(commands), static_cast<unsigned long long>(commits),
              static_cast<unsigned long long>(streams));
  for (const auto& [code, n] : inserts) {
    std::printf(" %s %llu", absl::StatusCodeToString(code).c_str(),
                static_cast<unsigned long long>(n));
  }
  std::printf("\n");
  EXPECT_GT(commands, 50u) << "the run sent too few commands to mean much";
  EXPECT_GT(commits, 50u) << "the run committed too little to mean much";
  EXPECT_GT(inserts[absl::StatusCode::kOk], 50u) << "too few inserts went through";
  for (uint64_t pin : pins) (void)client.Release(ns, pin);
  // The sweep of dropped pools finishes once nothing pins them.
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (manager.index().SweepRetired(0).remaining_pages > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(manager.index().SweepRetired(0).remaining_pages, 0u);
  ExpectConsistent(manager.index(), "end");
  absl::StatusOr<ManagerStats> stats = client.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
}

}  // namespace
}  // namespace kvcm
