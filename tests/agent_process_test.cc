// Multi-process test: a real kvcm-manager and a real kvcm-agent (host backend on machines
// without a GPU), observed through kvcmctl. The agent must show as alive in `kvcmctl stats`,
// show as gone within the heartbeat timeout after SIGKILL, and the manager must exit 0 on
// SIGTERM. An agent restarted under the same id registers a larger epoch, and the manager
// forgets the pages its previous process held.
//
// KVCM_MANAGER_PATH, KVCM_AGENT_PATH and KVCMCTL_PATH are the built binaries.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "tests/util/child_process.h"

namespace kvcm {
namespace {

using ::kvcm::testing::FreePort;
using ::kvcm::testing::OutputField;
using ::kvcm::testing::ProcessResult;
using ::kvcm::testing::ReadFile;
using ::kvcm::testing::Subprocess;

constexpr int kHeartbeatTimeoutMs = 500;

// The AGENTS row of `agent_id` in `kvcmctl stats` output; empty when absent.
std::string AgentRow(const std::string& stats, const std::string& agent_id) {
  const size_t table = stats.find("AGENTS (");
  if (table == std::string::npos) return "";
  for (absl::string_view line : absl::StrSplit(stats.substr(table), '\n')) {
    if (absl::StartsWith(line, agent_id + " ")) return std::string(line);
  }
  return "";
}

// The EPOCH column of an AGENTS row (AGENT DEVICE TIER STATE EPOCH ...); 0 when absent.
uint64_t RowEpoch(const std::string& row) {
  const std::vector<std::string> cols = absl::StrSplit(row, ' ', absl::SkipEmpty());
  uint64_t epoch = 0;
  if (cols.size() < 5 || !absl::SimpleAtoi(cols[4], &epoch)) return 0;
  return epoch;
}

class AgentProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    const std::string base =
        absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/kvcm_agent_process_", getpid());
    manager_log_ = base + "_manager.log";
    agent_log_ = base + "_agent.log";
    restarted_agent_log_ = base + "_agent2.log";
  }

  void TearDown() override {
    for (std::unique_ptr<Subprocess>* p : {&agent_, &manager_}) {
      if (*p != nullptr) {
        (*p)->Signal(SIGKILL);
        (*p)->Finish(absl::Seconds(10));
      }
    }
    if (HasFailure()) {
      std::fprintf(stderr, "--- manager log ---\n%s\n--- agent log ---\n%s\n",
                   ReadFile(manager_log_).c_str(), ReadFile(agent_log_).c_str());
      if (const std::string restarted = ReadFile(restarted_agent_log_); !restarted.empty()) {
        std::fprintf(stderr, "--- restarted agent log ---\n%s\n", restarted.c_str());
      }
    }
    std::remove(manager_log_.c_str());
    std::remove(agent_log_.c_str());
    std::remove(restarted_agent_log_.c_str());
  }

  ProcessResult Ctl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {KVCMCTL_PATH, "--insecure",
                                     absl::StrCat("--manager_address=127.0.0.1:", port_)};
    argv.insert(argv.end(), args.begin(), args.end());
    std::unique_ptr<Subprocess> p = Subprocess::Start(argv);
    if (p == nullptr) return ProcessResult{};
    return p->Finish(absl::Seconds(30));
  }

  // kvcmctl run that must exit 0; returns its stdout.
  std::string CtlOk(const std::vector<std::string>& args) {
    ProcessResult r = Ctl(args);
    EXPECT_TRUE(r.exited && r.exit_code == 0)
        << "kvcmctl " << absl::StrJoin(args, " ") << ": " << r.Describe();
    return r.out;
  }

  void StartManager(int heartbeat_timeout_ms = kHeartbeatTimeoutMs) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      port_ = FreePort();
      manager_ = Subprocess::Start(
          {KVCM_MANAGER_PATH, "--insecure", absl::StrCat("--listen_address=127.0.0.1:", port_),
           "--metrics_address=", "--shutdown_grace_ms=1000",
           absl::StrCat("--agent_heartbeat_timeout_ms=", heartbeat_timeout_ms)},
          manager_log_);
      ASSERT_NE(manager_, nullptr);
      const absl::Time give_up = absl::Now() + absl::Seconds(20);
      while (manager_->Running() && absl::Now() < give_up) {
        if (Ctl({"--deadline_ms=500", "stats"}).exit_code == 0) return;
        absl::SleepFor(absl::Milliseconds(50));
      }
      ASSERT_FALSE(manager_->Running()) << "kvcm-manager did not serve within 20 s";
      manager_.reset();
    }
    FAIL() << "kvcm-manager exited at start three times";
  }

  // Polls `kvcmctl stats` until gpu0's row satisfies `pred` or `timeout` passes; returns
  // the last row.
  template <typename Pred>
  std::string WaitForAgentRow(Pred pred, absl::Duration timeout) {
    const absl::Time give_up = absl::Now() + timeout;
    std::string row;
    do {
      ProcessResult r = Ctl({"--deadline_ms=2000", "stats"});
      row = AgentRow(r.out, "gpu0");
      if (pred(row)) return row;
      absl::SleepFor(absl::Milliseconds(20));
    } while (absl::Now() < give_up);
    return row;
  }

  // Polls until gpu0's row shows `state` ("alive", "gone").
  std::string WaitForAgentState(const std::string& state, absl::Duration timeout) {
    return WaitForAgentRow(
        [&](const std::string& row) {
          return absl::StrContains(row, absl::StrCat(" ", state, " "));
        },
        timeout);
  }

  // A kvcm-agent process "gpu0" (host backend without a GPU) logging to `log_path`.
  std::unique_ptr<Subprocess> StartAgent(const std::string& log_path) {
    return Subprocess::Start(
        {KVCM_AGENT_PATH, "--insecure", "--agent_id=gpu0",
         absl::StrCat("--manager_address=127.0.0.1:", port_), "--listen_address=127.0.0.1:0",
         "--model=deepseek-v3", "--capacity_bytes=50000000", "--heartbeat_interval_ms=100"},
        log_path);
  }

  std::string manager_log_;
  std::string agent_log_;
  std::string restarted_agent_log_;
  int port_ = 0;
  std::unique_ptr<Subprocess> manager_;
  std::unique_ptr<Subprocess> agent_;
};

TEST_F(AgentProcessTest, AgentShowsAliveThenGoneAfterSigkill) {
  ASSERT_NO_FATAL_FAILURE(StartManager());
  agent_ = Subprocess::Start(
      {KVCM_AGENT_PATH, "--insecure", "--agent_id=gpu0",
       absl::StrCat("--manager_address=127.0.0.1:", port_), "--listen_address=127.0.0.1:0",
       "--model=deepseek-v3", "--capacity_bytes=50000000", "--heartbeat_interval_ms=100"},
      agent_log_);
  ASSERT_NE(agent_, nullptr);

  const std::string alive = WaitForAgentState("alive", absl::Seconds(20));
  ASSERT_THAT(alive, ::testing::HasSubstr("alive")) << "agent never showed as alive";
  ASSERT_TRUE(agent_->Running());
  // Host DRAM on a machine without a GPU; either way the device column is filled in.
  EXPECT_THAT(alive, ::testing::ContainsRegex("gpu0 +(host|cuda:0) +gpu +alive"));

  agent_->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  ProcessResult agent_end = agent_->Finish(absl::Seconds(10));
  EXPECT_EQ(agent_end.term_signal, SIGKILL);
  const std::string gone = WaitForAgentState("gone", absl::Seconds(10));
  const absl::Duration took = absl::Now() - killed;
  ASSERT_THAT(gone, ::testing::HasSubstr("gone"));
  // Gone once the timeout has passed since the last heartbeat: at most the timeout after
  // the kill, plus one kvcmctl round trip of slack.
  EXPECT_LE(took, absl::Milliseconds(kHeartbeatTimeoutMs) + absl::Seconds(2)) << took;
  EXPECT_THAT(ReadFile(agent_log_), ::testing::HasSubstr("registered with"));

  manager_->Signal(SIGTERM);
  ProcessResult manager_end = manager_->Finish(absl::Seconds(15));
  EXPECT_TRUE(manager_end.exited && manager_end.exit_code == 0) << manager_end.Describe();
}

TEST_F(AgentProcessTest, AgentExitsZeroOnSigterm) {
  ASSERT_NO_FATAL_FAILURE(StartManager());
  agent_ = Subprocess::Start({KVCM_AGENT_PATH, "--insecure", "--agent_id=gpu0",
                              absl::StrCat("--manager_address=127.0.0.1:", port_),
                              "--capacity_bytes=50000000", "--heartbeat_interval_ms=100"},
                             agent_log_);
  ASSERT_NE(agent_, nullptr);
  ASSERT_THAT(WaitForAgentState("alive", absl::Seconds(20)), ::testing::HasSubstr("alive"));
  agent_->Signal(SIGTERM);
  ProcessResult end = agent_->Finish(absl::Seconds(15));
  EXPECT_TRUE(end.exited && end.exit_code == 0) << end.Describe();
}

// SIGKILL, then a new process under the same id: it registers a larger epoch and the manager
// drops the pages the killed process held. The heartbeat timeout is long, so that the pages
// go because of the new epoch, not because the old one was declared gone.
TEST_F(AgentProcessTest, RestartedAgentRegistersANewEpochAndItsOldPagesAreDropped) {
  ASSERT_NO_FATAL_FAILURE(StartManager(/*heartbeat_timeout_ms=*/60'000));
  agent_ = StartAgent(agent_log_);
  ASSERT_NE(agent_, nullptr);
  const std::string alive = WaitForAgentState("alive", absl::Seconds(20));
  ASSERT_THAT(alive, ::testing::HasSubstr("alive")) << "agent never showed as alive";
  const uint64_t old_epoch = RowEpoch(alive);
  ASSERT_NE(old_epoch, 0u) << alive;

  // The agent's model namespace, and a prompt of 300 tokens = 4 whole pages of 64 in its pool.
  const std::vector<std::string> prompt = {"--tenant=acme", "--model=deepseek-v3",
                                           "--random_tokens=300", "--seed=7"};
  std::string out =
      CtlOk({"register-model", "--tenant=acme", "--model=deepseek-v3", "--preset=deepseek-v3"});
  EXPECT_THAT(out, ::testing::HasSubstr("(created)"));
  // kvcmctl allocates the blocks on the agent (a fresh pool hands out 0, 1, 2, 3) and the
  // agent commits them.
  std::vector<std::string> insert = {"insert", "--agent=gpu0", "--tier=gpu"};
  insert.insert(insert.end(), prompt.begin(), prompt.end());
  out = CtlOk(insert);
  EXPECT_EQ(OutputField(out, "pool"), "gpu0:gpu") << out;
  EXPECT_EQ(OutputField(out, "new_pages"), "4") << out;
  EXPECT_EQ(OutputField(out, "block_ids"), "0,1,2,3") << out;
  EXPECT_EQ(OutputField(out, "agent_epoch"), absl::StrCat(old_epoch)) << out;
  std::vector<std::string> match = {"match"};
  match.insert(match.end(), prompt.begin(), prompt.end());
  out = CtlOk(match);
  EXPECT_EQ(OutputField(out, "prompt_pages"), "4") << out;
  EXPECT_EQ(OutputField(out, "matched_pages"), "4") << out;
  EXPECT_THAT(out, ::testing::HasSubstr("gpu0:gpu blocks 0,1,2,3"));
  out = CtlOk({"stats"});
  EXPECT_THAT(out, ::testing::ContainsRegex("\ngpu0 +gpu +[^\n]* 4 +[0-9.]+\n")) << out;

  agent_->Signal(SIGKILL);
  ProcessResult killed = agent_->Finish(absl::Seconds(10));
  EXPECT_EQ(killed.term_signal, SIGKILL) << killed.Describe();
  agent_ = StartAgent(restarted_agent_log_);
  ASSERT_NE(agent_, nullptr);
  const std::string again = WaitForAgentRow(
      [&](const std::string& row) {
        return absl::StrContains(row, " alive ") && RowEpoch(row) != old_epoch;
      },
      absl::Seconds(20));
  ASSERT_THAT(again, ::testing::HasSubstr(" alive ")) << "the restarted agent never registered";
  const uint64_t new_epoch = RowEpoch(again);
  EXPECT_GT(new_epoch, old_epoch) << again;
  EXPECT_THAT(ReadFile(restarted_agent_log_),
              ::testing::HasSubstr(absl::StrCat("as gpu0 epoch ", new_epoch)));

  out = CtlOk(match);
  EXPECT_EQ(OutputField(out, "prompt_pages"), "4") << out;
  EXPECT_EQ(OutputField(out, "matched_pages"), "0") << out;
  EXPECT_THAT(out, ::testing::Not(::testing::HasSubstr("gpu0:gpu blocks")));
  // The pool's row comes to count no page (PAGES 0, USED% 0.00; polled, as the index may
  // sweep a dropped pool's pages after the fact); one agent row, the new epoch's.
  const auto no_pages = ::testing::ContainsRegex("\ngpu0 +gpu +[^\n]* 0 +0\\.00\n");
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  std::string stats;
  do {
    stats = CtlOk({"stats"});
    if (::testing::Value(stats, no_pages)) break;
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < give_up);
  EXPECT_THAT(stats, no_pages) << stats;
  EXPECT_THAT(stats, ::testing::HasSubstr("AGENTS (1)\n")) << stats;
}

TEST_F(AgentProcessTest, BadOptionsExitNonZeroNamingTheField) {
  std::unique_ptr<Subprocess> p =
      Subprocess::Start({KVCM_AGENT_PATH, "--insecure", "--agent_id=gpu0", "--model=deepseek-v3",
                         "--capacity_bytes=1000"});
  ASSERT_NE(p, nullptr);
  ProcessResult r = p->Finish(absl::Seconds(15));
  EXPECT_TRUE(r.exited && r.exit_code == 1) << r.Describe();
  EXPECT_THAT(r.err, ::testing::HasSubstr("capacity_bytes"));
}

TEST_F(AgentProcessTest, NeitherTlsNorInsecureExitsNamingTheOptions) {
  std::unique_ptr<Subprocess> p = Subprocess::Start({KVCM_AGENT_PATH, "--agent_id=gpu0"});
  ASSERT_NE(p, nullptr);
  ProcessResult r = p->Finish(absl::Seconds(15));
  EXPECT_TRUE(r.exited && r.exit_code == 1) << r.Describe();
  EXPECT_THAT(r.err, ::testing::HasSubstr("tls_cert_file, tls_key_file and tls_ca_file"));
  EXPECT_THAT(r.err, ::testing::HasSubstr("insecure"));
}

}  // namespace
}  // namespace kvcm
