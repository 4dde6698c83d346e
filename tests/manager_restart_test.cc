// kill -9 of the manager under load, as separate processes crossing real sockets: one
// kvcm-manager, two kvcm-agents (host pools) and a worker simulator that inserts prompts
// through kvcmctl (which allocates blocks on the agent, inserts them, and frees what the
// manager did not keep). The manager is killed mid-load and restarted on the same port with
// the same hash secret; the agents re-register their epochs and report their inventories.
// Then every prompt inserted before the kill matches again in the same blocks, no block
// holds two pages, and no block leaked: every allocated block of each agent is indexed.

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/credentials.h"
#include "gtest/gtest.h"
#include "kvcm/v1/agent.grpc.pb.h"
#include "tests/util/child_process.h"

namespace kvcm {
namespace {

using ::kvcm::testing::FreePort;
using ::kvcm::testing::OutputField;
using ::kvcm::testing::ProcessResult;
using ::kvcm::testing::ReadFile;
using ::kvcm::testing::Subprocess;
using ::kvcm::testing::WaitUntil;

constexpr char kSecret[] = "0123456789abcdef0123456789abcdef";
constexpr uint64_t kPageBytes = 1152ull * 61 * 64;  // DeepSeek-V3 bf16, 64 tokens
constexpr uint64_t kAgentBlocks = 32;
constexpr int kPrompts = 16;  // 3 pages each, alternating agents: no agent fills up
const NamespaceId kNs{"acme", "deepseek-v3"};

std::string Agent(int seed) { return absl::StrCat("gpu", seed % 2); }

// The deterministic prompt of `seed`: what kvcmctl --random_tokens=200 --seed=N sends.
std::vector<std::string> PromptFlags(int seed) {
  return {"--tenant=acme", "--model=deepseek-v3", "--random_tokens=200",
          absl::StrCat("--seed=", seed)};
}

class ManagerRestartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    base_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/kvcm_restart_", getpid());
    port_ = FreePort();
  }

  void TearDown() override {
    std::vector<std::unique_ptr<Subprocess>*> all = {&manager_};
    for (auto& a : agents_) all.push_back(&a);
    for (std::unique_ptr<Subprocess>* p : all) {
      if (*p != nullptr) {
        (*p)->Signal(SIGKILL);
        (*p)->Finish(absl::Seconds(10));
      }
    }
    for (const char* name : {"manager", "manager2", "gpu0", "gpu1"}) {
      const std::string path = absl::StrCat(base_, "_", name, ".log");
      if (HasFailure()) std::fprintf(stderr, "--- %s ---\n%s\n", name, ReadFile(path).c_str());
      std::remove(path.c_str());
    }
  }

  // The secret as kvcm-manager takes it: from a file (never from argv).
  std::string SecretFile() {
    const std::string path = absl::StrCat(base_, "_secret");
    std::FILE* f = std::fopen(path.c_str(), "w");
    std::fputs(kSecret, f);
    std::fclose(f);
    return path;
  }

  void StartManager(const std::string& log) {
    manager_ = Subprocess::Start(
        {KVCM_MANAGER_PATH, "--insecure", absl::StrCat("--listen_address=127.0.0.1:", port_),
         "--metrics_address=", "--shutdown_grace_ms=500", "--agent_heartbeat_timeout_ms=10000",
         absl::StrCat("--hash_secret_file=", SecretFile())},
        absl::StrCat(base_, "_", log, ".log"));
    ASSERT_NE(manager_, nullptr);
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (manager_->Running() && absl::Now() < give_up) {
      if (Ctl({"--deadline_ms=500", "stats"}).exit_code == 0) return;
      absl::SleepFor(absl::Milliseconds(50));
    }
    FAIL() << "kvcm-manager did not serve within 20 s";
  }

  void StartAgent(int i) {
    const std::string id = absl::StrCat("gpu", i);
    agents_[i] = Subprocess::Start(
        {KVCM_AGENT_PATH, "--insecure", absl::StrCat("--agent_id=", id),
         absl::StrCat("--manager_address=127.0.0.1:", port_), "--listen_address=127.0.0.1:0",
         "--model=deepseek-v3", absl::StrCat("--capacity_bytes=", kAgentBlocks * kPageBytes),
         "--heartbeat_interval_ms=100"},
        absl::StrCat(base_, "_", id, ".log"));
    ASSERT_NE(agents_[i], nullptr);
  }

  ProcessResult Ctl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {KVCMCTL_PATH, "--insecure",
                                     absl::StrCat("--manager_address=127.0.0.1:", port_),
                                     "--deadline_ms=3000"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::unique_ptr<Subprocess> p = Subprocess::Start(argv);
    if (p == nullptr) return ProcessResult{};
    return p->Finish(absl::Seconds(30));
  }

  std::unique_ptr<Client> Connect() {
    absl::StatusOr<std::unique_ptr<Client>> c =
        Client::Connect({.address = absl::StrCat("127.0.0.1:", port_), .insecure = true});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // Block ids of the replica of the prompt of `seed` on its agent, as the manager matches it
  // (kvcmctl match).
  std::string Matched(int seed) {
    ProcessResult r = Ctl([&] {
      std::vector<std::string> a = {"match"};
      for (const std::string& f : PromptFlags(seed)) a.push_back(f);
      return a;
    }());
    const std::string want = absl::StrCat(Agent(seed), ":gpu blocks ");
    for (absl::string_view line : absl::StrSplit(r.out, '\n')) {
      const size_t at = line.find(want);
      if (at != absl::string_view::npos) return std::string(line.substr(at + want.size()));
    }
    return "";
  }

  // (agent address, allocated blocks on the agent, pages its pool holds in the index).
  struct Usage {
    uint64_t allocated = 0;
    uint64_t indexed = 0;
  };
  std::map<std::string, Usage> Usages(Client& client) {
    std::map<std::string, Usage> out;
    absl::StatusOr<ManagerStats> stats = client.Stats();
    if (!stats.ok()) return out;
    for (const ManagerStats::Agent& a : stats->agents) {
      auto stub = v1::BlockAgent::NewStub(MakeInsecureChannel(a.block_agent_address));
      v1::BlockAgentStatsResponse s;
      grpc::ClientContext ctx;
      if (!stub->Stats(&ctx, v1::BlockAgentStatsRequest(), &s).ok()) continue;
      out[a.agent_id].allocated = s.geometry().num_blocks() - s.free_blocks();
    }
    for (const ManagerStats::Pool& p : stats->pools) out[p.pool.agent_id].indexed += p.pages;
    return out;
  }

  std::string base_;
  int port_ = 0;
  std::unique_ptr<Subprocess> manager_;
  std::unique_ptr<Subprocess> agents_[2];
};

TEST_F(ManagerRestartTest, KillNineMidLoadLosesNoPageAndLeaksNoBlock) {
  ASSERT_NO_FATAL_FAILURE(StartManager("manager"));
  StartAgent(0);
  StartAgent(1);
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(WaitUntil(
      [&] {
        absl::StatusOr<ManagerStats> s = client->Stats();
        return s.ok() && s->agents.size() == 2;
      },
      absl::Seconds(20)))
      << "the agents never registered";
  ASSERT_EQ(Ctl({"register-model", "--tenant=acme", "--model=deepseek-v3", "--preset=deepseek-v3"})
                .exit_code,
            0);

  // The worker simulator: one prompt after another, recording what each insert answered.
  absl::Mutex mu;
  std::map<int, std::string> inserted;  // seed -> block ids, for inserts that succeeded
  std::atomic<int> done{0};
  std::thread worker([&] {
    for (int seed = 1; seed <= kPrompts; ++seed) {
      std::vector<std::string> args = {"insert", absl::StrCat("--agent=", Agent(seed))};
      for (const std::string& f : PromptFlags(seed)) args.push_back(f);
      // A worker retries while the manager is away (up to 20 s per prompt).
      const absl::Time give_up = absl::Now() + absl::Seconds(20);
      do {
        ProcessResult r = Ctl(args);
        // No block_ids: kvcmctl found the agent not yet re-registered with the new manager
        // and inserted index-only blocks (replaced by the agent's inventory when it
        // registers): not a worker's insert, so try again.
        if (r.exited && r.exit_code == 0 && !OutputField(r.out, "block_ids").empty()) {
          absl::MutexLock lock(&mu);
          inserted[seed] = OutputField(r.out, "block_ids");
          break;
        }
        absl::SleepFor(absl::Milliseconds(50));
      } while (absl::Now() < give_up);
      done.fetch_add(1);
    }
  });

  // kill -9 once some prompts are in, with the worker still going.
  ASSERT_TRUE(WaitUntil([&] { return done.load() >= 5; }, absl::Seconds(60)));
  ASSERT_LT(done.load(), kPrompts) << "the worker finished before the kill";
  manager_->Signal(SIGKILL);
  ProcessResult killed = manager_->Finish(absl::Seconds(10));
  EXPECT_EQ(killed.term_signal, SIGKILL);
  std::map<int, std::string> before_kill;
  {
    absl::MutexLock lock(&mu);
    before_kill = inserted;
  }
  ASSERT_GE(before_kill.size(), 3u);
  absl::SleepFor(absl::Milliseconds(300));  // a few heartbeats fail meanwhile
  ASSERT_NO_FATAL_FAILURE(StartManager("manager2"));
  worker.join();

  std::printf("prompts inserted: %zu of %d, %zu of them before the kill\n", inserted.size(),
              kPrompts, before_kill.size());
  client = Connect();
  ASSERT_NE(client, nullptr);
  // Every insert that succeeded, before or after the kill, matches in the same blocks.
  for (const auto& [seed, blocks] : inserted) {
    EXPECT_TRUE(WaitUntil([&] { return Matched(seed) == blocks; }, absl::Seconds(20)))
        << "prompt " << seed << " on " << Agent(seed) << ": inserted in blocks " << blocks
        << ", matched in '" << Matched(seed) << "'"
        << (before_kill.contains(seed) ? " (before the kill)" : "");
  }
  // No block holds two pages.
  std::set<std::pair<std::string, std::string>> seen;
  for (const auto& [seed, blocks] : inserted) {
    for (absl::string_view b : absl::StrSplit(blocks, ',')) {
      EXPECT_TRUE(seen.emplace(Agent(seed), std::string(b)).second)
          << Agent(seed) << " block " << b << " holds two pages";
    }
  }
  // No block leaked: with the worker done, every allocated block is indexed (an insert cut
  // by the kill after its commit came back through the inventory).
  std::map<std::string, Usage> usage;
  EXPECT_TRUE(WaitUntil(
      [&] {
        usage = Usages(*client);
        return usage.size() == 2 && usage["gpu0"].allocated == usage["gpu0"].indexed &&
               usage["gpu1"].allocated == usage["gpu1"].indexed;
      },
      absl::Seconds(10)));
  for (const auto& [agent, u] : usage) {
    EXPECT_EQ(u.allocated, u.indexed) << agent << ": allocated blocks vs indexed pages";
    EXPECT_GT(u.indexed, 0u) << agent;
  }
}

}  // namespace
}  // namespace kvcm
