// Multi-process test: a real kvcm-manager process driven by kvcmctl processes, as an
// operator would. Processes are started with posix_spawn (no shell); kvcmctl's output is
// read through pipes, the manager's goes to a log file that failures print.
//
// KVCM_MANAGER_PATH, KVCM_AGENT_PATH and KVCMCTL_PATH are the built binaries (compile
// definitions).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/child_process.h"
#include "tests/util/http_get.h"
#include "tests/util/test_certs.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using ::kvcm::testing::FreePort;
using ::kvcm::testing::HttpGet;
using ::kvcm::testing::ProcessResult;
using ::kvcm::testing::ReadFile;
using ::kvcm::testing::Subprocess;
using ::kvcm::testing::TestCerts;

// The unsigned number after "key: " in `text`; 0 when absent.
uint64_t Field(const std::string& text, const std::string& key) {
  const size_t at = text.find(key + ": ");
  if (at == std::string::npos) {
    return 0;
  }
  const size_t begin = at + key.size() + 2;
  uint64_t value = 0;
  if (!absl::SimpleAtoi(text.substr(begin, text.find_first_of(" \n", begin) - begin), &value)) {
    return 0;
  }
  return value;
}

// The value of "key" in kvcmctl --json output, quotes stripped (the first occurrence); ""
// when absent. Enough for the flat fields these tests read.
std::string JsonField(const std::string& json, const std::string& key) {
  const std::string needle = absl::StrCat("\"", key, "\":");
  const size_t at = json.find(needle);
  if (at == std::string::npos) return "";
  const size_t begin = at + needle.size();
  if (begin < json.size() && json[begin] == '"') {
    return json.substr(begin + 1, json.find('"', begin + 1) - begin - 1);
  }
  return json.substr(begin, json.find_first_of(",}]", begin) - begin);
}

// --json output: exactly one line, one object.
void ExpectOneJsonObject(const std::string& out) {
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.front(), '{') << out;
  EXPECT_EQ(out.substr(out.size() - 2), "}\n") << out;
  EXPECT_EQ(out.find('\n'), out.size() - 1) << out;
}

constexpr absl::Duration kCtlTimeout = absl::Seconds(30);

class KvcmctlProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    log_path_ =
        absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/kvcm_process_test_", getpid(), "_",
                     ::testing::UnitTest::GetInstance()->current_test_info()->name(), ".log");
  }

  void TearDown() override {
    if (manager_ != nullptr) {
      manager_->Signal(SIGKILL);
      manager_->Finish(absl::Seconds(10));
    }
    if (HasFailure()) {
      std::fprintf(stderr, "--- manager log ---\n%s\n", ReadFile(log_path_).c_str());
    }
    std::remove(log_path_.c_str());
  }

  // Starts kvcm-manager on free ports and waits until `kvcmctl stats` succeeds. Retries
  // with other ports when the manager exits early (a port taken in between).
  void StartManager() {
    for (int attempt = 0; attempt < 3; ++attempt) {
      port_ = FreePort();
      metrics_port_ = FreePort();
      std::vector<std::string> argv = {
          KVCM_MANAGER_PATH, absl::StrCat("--listen_address=127.0.0.1:", port_),
          absl::StrCat("--metrics_address=127.0.0.1:", metrics_port_), "--shutdown_grace_ms=1000"};
      argv.insert(argv.end(), manager_security_.begin(), manager_security_.end());
      manager_ = Subprocess::Start(argv, log_path_);
      ASSERT_NE(manager_, nullptr);
      const absl::Time give_up = absl::Now() + absl::Seconds(20);
      while (manager_->Running() && absl::Now() < give_up) {
        if (Ctl({"--deadline_ms=500", "stats"}).exit_code == 0) {
          return;
        }
        absl::SleepFor(absl::Milliseconds(50));
      }
      ASSERT_FALSE(manager_->Running()) << "kvcm-manager did not serve within 20 s";
      manager_.reset();
    }
    FAIL() << "kvcm-manager exited at start three times";
  }

  // Runs kvcmctl against the manager with `args` (after ctl_security_) and waits for it.
  ProcessResult Ctl(const std::vector<std::string>& args) { return CtlWith(ctl_security_, args); }
  // The same with the global flags `security` instead of ctl_security_.
  ProcessResult CtlWith(const std::vector<std::string>& security,
                        const std::vector<std::string>& args) {
    std::vector<std::string> argv = {KVCMCTL_PATH,
                                     absl::StrCat("--manager_address=127.0.0.1:", port_)};
    argv.insert(argv.end(), security.begin(), security.end());
    argv.insert(argv.end(), args.begin(), args.end());
    std::unique_ptr<Subprocess> p = Subprocess::Start(argv);
    if (p == nullptr) {
      return ProcessResult{};
    }
    return p->Finish(kCtlTimeout);
  }

  // kvcmctl run that must succeed; returns its stdout.
  std::string CtlOk(const std::vector<std::string>& args) {
    ProcessResult r = Ctl(args);
    EXPECT_TRUE(r.exited && r.exit_code == 0)
        << "kvcmctl " << absl::StrJoin(args, " ") << ": " << r.Describe();
    return r.out;
  }

  // kvcmctl with `env` ("NAME=value" pairs) added to its environment and `args` (no
  // --manager_address unless given).
  ProcessResult CtlEnv(const std::vector<std::string>& env, const std::vector<std::string>& args) {
    std::vector<std::string> argv = {"/usr/bin/env"};
    argv.insert(argv.end(), env.begin(), env.end());
    argv.push_back(KVCMCTL_PATH);
    argv.insert(argv.end(), args.begin(), args.end());
    std::unique_ptr<Subprocess> p = Subprocess::Start(argv);
    if (p == nullptr) {
      return ProcessResult{};
    }
    return p->Finish(kCtlTimeout);
  }

  // Transport security flags of the manager and of kvcmctl: plaintext unless a test sets TLS.
  std::vector<std::string> manager_security_ = {"--insecure"};
  std::vector<std::string> ctl_security_ = {"--insecure"};
  std::string log_path_;
  int port_ = 0;
  int metrics_port_ = 0;
  std::unique_ptr<Subprocess> manager_;
};

const std::vector<std::string> kNs = {"--tenant=acme", "--model=deepseek-v3"};

std::vector<std::string> With(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_F(KvcmctlProcessTest, OperatorWorkflowAgainstARealManager) {
  ASSERT_NO_FATAL_FAILURE(StartManager());

  std::string out = CtlOk(
      With({"register-model"},
           With(kNs, {"--attention=mla", "--num_layers=61", "--num_heads=128", "--kv_lora_rank=512",
                      "--rope_dim=64", "--kv_dtype=bf16", "--page_size_tokens=64"})));
  EXPECT_THAT(out, HasSubstr("(created)"));
  EXPECT_EQ(Field(out, "bytes_per_token"), 70'272u);
  EXPECT_EQ(Field(out, "bytes_per_page"), 70'272u * 64);

  // 300 tokens = 4 whole pages of 64 (the trailing 44 are never cached).
  const std::vector<std::string> prompt = {"--random_tokens=300", "--seed=7"};
  out = CtlOk(With({"insert"}, With(kNs, With(prompt, {"--agent=agent-0", "--first_block=100"}))));
  EXPECT_EQ(Field(out, "new_pages"), 4u) << out;

  out = CtlOk(With({"match"}, With(kNs, With(prompt, {"--agent=agent-0"}))));
  EXPECT_EQ(Field(out, "prompt_pages"), 4u) << out;
  EXPECT_EQ(Field(out, "matched_pages"), 4u) << out;
  EXPECT_EQ(Field(out, "matched_tokens"), 256u) << out;
  EXPECT_EQ(Field(out, "local_pages"), 4u) << out;
  EXPECT_THAT(out, HasSubstr("agent-0:gpu blocks 100,101,102,103"));
  EXPECT_THAT(out, Not(HasSubstr("pin_id")));  // no pin, no pin id

  // Another seed shares nothing.
  out = CtlOk(With({"match"}, With(kNs, {"--random_tokens=300", "--seed=8"})));
  EXPECT_THAT(out, HasSubstr("matched_pages: 0\n"));

  out = CtlOk(With({"match"}, With(kNs, With(prompt, {"--pin", "--lease_ttl_ms=60000"}))));
  const uint64_t pin_id = Field(out, "pin_id");
  ASSERT_NE(pin_id, 0u) << out;
  EXPECT_THAT(out, HasSubstr("lease_expiry: "));

  out = CtlOk({"stats"});
  EXPECT_THAT(out, HasSubstr("active_pins=1"));
  EXPECT_THAT(out, HasSubstr("acme/deepseek-v3"));
  EXPECT_THAT(out, HasSubstr("70272"));
  EXPECT_THAT(out, HasSubstr("agent-0"));
  EXPECT_THAT(out, testing::ContainsRegex("inserted_pages +4\n"));
  EXPECT_THAT(out, testing::ContainsRegex("pins_taken +1\n"));

  out = CtlOk(With({"release"}, With(kNs, {absl::StrCat("--pin_id=", pin_id)})));
  EXPECT_THAT(out, HasSubstr(absl::StrCat("released pin ", pin_id)));
  ProcessResult again = Ctl(With({"release"}, With(kNs, {absl::StrCat("--pin_id=", pin_id)})));
  EXPECT_EQ(again.exit_code, 1) << again.Describe();
  EXPECT_THAT(again.err, HasSubstr("NOT_FOUND"));
  EXPECT_THAT(CtlOk({"stats"}), HasSubstr("active_pins=0"));

  // One page out of the pool, then the rest of the namespace.
  out = CtlOk({"evict", "--agent=agent-0", "--tier=gpu", "--bytes=1"});
  EXPECT_GE(Field(out, "evicted_pages"), 1u) << out;
  EXPECT_GE(Field(out, "evicted_bytes"), 70'272u * 64) << out;
  ProcessResult too_much = Ctl(With({"evict", "--bytes=1000000000000"}, kNs));
  EXPECT_EQ(too_much.exit_code, 1) << too_much.Describe();
  EXPECT_THAT(too_much.err, HasSubstr("OUT_OF_RANGE"));

  // The exporter serves Prometheus text with kvcm_ metrics.
  const std::string metrics = HttpGet(metrics_port_, "/metrics");
  EXPECT_THAT(metrics, HasSubstr(" 200 "));
  EXPECT_THAT(metrics, HasSubstr("kvcm_"));

  manager_->Signal(SIGTERM);
  ProcessResult stopped = manager_->Finish(absl::Seconds(15));
  manager_.reset();
  EXPECT_TRUE(stopped.exited && stopped.exit_code == 0)
      << stopped.Describe() << ReadFile(log_path_);
  // Gone for good: kvcmctl now reports UNAVAILABLE and exits 1.
  ProcessResult after = Ctl({"--deadline_ms=300", "stats"});
  EXPECT_EQ(after.exit_code, 1) << after.Describe();
  EXPECT_THAT(after.err, HasSubstr("UNAVAILABLE"));
}

TEST_F(KvcmctlProcessTest, WatchPrintsStoredEvents) {
  ASSERT_NO_FATAL_FAILURE(StartManager());
  CtlOk(With({"register-model"},
             With(kNs, {"--attention=gqa", "--num_layers=80", "--num_heads=64", "--num_kv_heads=8",
                        "--head_dim=128", "--page_size_tokens=16"})));
  std::unique_ptr<Subprocess> watch = Subprocess::Start(
      {KVCMCTL_PATH, "--insecure", absl::StrCat("--manager_address=127.0.0.1:", port_), "watch",
       "--tenant=acme", "--model=deepseek-v3", "--count=1", "--duration_ms=20000"});
  ASSERT_NE(watch, nullptr);
  std::unique_ptr<Subprocess> json_watch = Subprocess::Start(
      {KVCMCTL_PATH, "--insecure", absl::StrCat("--manager_address=127.0.0.1:", port_), "watch",
       "--json", "--count=1", "--duration_ms=20000"});
  ASSERT_NE(json_watch, nullptr);
  // The subscription is live at some point after the process starts: insert fresh prompts
  // until the watchers have seen one and exited.
  for (int seed = 1; (watch->Running() || json_watch->Running()) && seed < 100; ++seed) {
    CtlOk(With({"insert"}, With(kNs, {"--random_tokens=32", absl::StrCat("--seed=", seed),
                                      "--agent=agent-1", "--tier=host"})));
    absl::SleepFor(absl::Milliseconds(100));
  }
  ProcessResult r = watch->Finish(absl::Seconds(20));
  EXPECT_TRUE(r.exited && r.exit_code == 0) << r.Describe();
  EXPECT_THAT(r.out, HasSubstr("stored ns=acme/deepseek-v3 pool=agent-1:host pages=2"));
  ProcessResult j = json_watch->Finish(absl::Seconds(20));
  EXPECT_TRUE(j.exited && j.exit_code == 0) << j.Describe();
  ExpectOneJsonObject(j.out);
  EXPECT_EQ(JsonField(j.out, "kind"), "KIND_STORED") << j.out;
  EXPECT_EQ(JsonField(j.out, "agent_id"), "agent-1") << j.out;
  EXPECT_EQ(JsonField(j.out, "sequence"), "1") << j.out;
}

// --json: every command prints its reply as one JSON object; a pin id read from it releases
// the pin.
TEST_F(KvcmctlProcessTest, JsonOutputParsesBack) {
  ASSERT_NO_FATAL_FAILURE(StartManager());
  std::string out = CtlOk(With({"--json", "register-model", "--preset=deepseek-v3"}, kNs));
  ExpectOneJsonObject(out);
  EXPECT_EQ(JsonField(out, "bytes_per_token"), "70272") << out;
  EXPECT_EQ(JsonField(out, "created"), "true") << out;
  EXPECT_EQ(JsonField(out, "hash_key"), "") << "the namespace's secret is never printed: " << out;
  const std::vector<std::string> prompt = {"--random_tokens=300", "--seed=7"};
  out =
      CtlOk(With({"insert", "--json"}, With(kNs, With(prompt, {"--agent=a0", "--first_block=9"}))));
  ExpectOneJsonObject(out);
  EXPECT_EQ(JsonField(out, "new_pages"), "4") << out;

  // Unpinned: pin_id 0 in JSON (every field printed), no pin taken.
  out = CtlOk(With({"match", "--json"}, With(kNs, prompt)));
  ExpectOneJsonObject(out);
  EXPECT_EQ(JsonField(out, "matched_pages"), "4") << out;
  EXPECT_EQ(JsonField(out, "pin_id"), "0") << out;
  // The flag after the command or before it: the same.
  out = CtlOk(With({"--json", "match"}, With(kNs, With(prompt, {"--pin"}))));
  ExpectOneJsonObject(out);
  const std::string pin = JsonField(out, "pin_id");
  ASSERT_NE(pin, "0") << out;
  ASSERT_NE(pin, "") << out;
  EXPECT_EQ(JsonField(CtlOk({"--json", "stats"}), "active_pins"), "1");
  out = CtlOk(With({"renew", "--json", "--lease_ttl_ms=60000"}, With(kNs, {"--pin_id=" + pin})));
  ExpectOneJsonObject(out);
  EXPECT_NE(JsonField(out, "lease_expiry_unix_ms"), "0") << out;
  out = CtlOk(With({"release", "--json"}, With(kNs, {"--pin_id=" + pin})));
  EXPECT_EQ(out, "{}\n");
  EXPECT_EQ(JsonField(CtlOk({"--json", "stats"}), "active_pins"), "0");
  ProcessResult again = Ctl(With({"release", "--json"}, With(kNs, {"--pin_id=" + pin})));
  EXPECT_EQ(again.exit_code, 1) << again.Describe();
  EXPECT_THAT(again.err, HasSubstr("NOT_FOUND"));
  EXPECT_EQ(again.out, "") << "errors go to stderr only";

  // route --json: AgentStatsAndLookupAgent (route needs a live agent).
  out = CtlOk({"evict", "--json", "--agent=a0", "--bytes=1"});
  ExpectOneJsonObject(out);
  EXPECT_NE(JsonField(out, "evicted_pages"), "0") << out;
  out = CtlOk({"--json", "stats"});
  ExpectOneJsonObject(out);
  EXPECT_EQ(JsonField(out, "tenant"), "acme") << out;
  out = CtlOk(With({"delete-namespace", "--json"}, kNs));
  ExpectOneJsonObject(out);
  EXPECT_EQ(JsonField(out, "dropped_pins"), "0") << out;
}

// reserve holds headroom in a pool (stats shows it) and unreserve gives it back; what the
// manager refuses changes nothing.
TEST_F(KvcmctlProcessTest, ReserveAndUnreserve) {
  ASSERT_NO_FATAL_FAILURE(StartManager());
  CtlOk(With({"register-model", "--preset=deepseek-v3"}, kNs));
  CtlOk(With({"insert"}, With(kNs, {"--random_tokens=300", "--agent=a0", "--first_block=0"})));
  auto reserved = [&] { return JsonField(CtlOk({"--json", "stats"}), "reserved_bytes"); };
  EXPECT_EQ(reserved(), "0");

  std::string out = CtlOk({"reserve", "--agent=a0", "--tier=gpu", "--bytes=4096"});
  EXPECT_THAT(out, HasSubstr("reserved 4096 bytes in a0:gpu\n"));
  EXPECT_EQ(Field(out, "evicted_bytes"), 0u) << out;
  EXPECT_EQ(reserved(), "4096");
  out = CtlOk({"reserve", "--json", "--agent=a0", "--bytes=100"});
  EXPECT_EQ(out, "{\"evicted_bytes\":\"0\"}\n");
  EXPECT_EQ(reserved(), "4196");

  // More than is reserved, an unknown pool, a bad flag: refused, nothing changes.
  ProcessResult too_much = Ctl({"unreserve", "--agent=a0", "--bytes=100000"});
  EXPECT_EQ(too_much.exit_code, 1) << too_much.Describe();
  EXPECT_THAT(too_much.err, HasSubstr("OUT_OF_RANGE"));
  ProcessResult unknown = Ctl({"reserve", "--agent=nope", "--bytes=1"});
  EXPECT_EQ(unknown.exit_code, 1) << unknown.Describe();
  EXPECT_THAT(unknown.err, HasSubstr("NOT_FOUND"));
  ProcessResult no_bytes = Ctl({"unreserve", "--agent=a0"});
  EXPECT_EQ(no_bytes.exit_code, 2) << no_bytes.Describe();
  EXPECT_EQ(reserved(), "4196");
  EXPECT_THAT(CtlOk({"stats"}), Not(HasSubstr("nope")));

  out = CtlOk({"unreserve", "--agent=a0", "--bytes=4196"});
  EXPECT_THAT(out, HasSubstr("unreserved 4196 bytes in a0:gpu\n"));
  EXPECT_EQ(reserved(), "0");

  // A tenant's headroom (no tokens: every caller is an admin) is not the operators'.
  CtlOk({"reserve", "--agent=a0", "--bytes=512", "--tenant=acme"});
  EXPECT_EQ(reserved(), "512");
  ProcessResult operators = Ctl({"unreserve", "--agent=a0", "--bytes=512"});
  EXPECT_EQ(operators.exit_code, 1) << operators.Describe();
  EXPECT_THAT(operators.err, HasSubstr("OUT_OF_RANGE"));
  EXPECT_EQ(reserved(), "512");
  CtlOk({"unreserve", "--agent=a0", "--bytes=512", "--tenant=acme"});
  EXPECT_EQ(reserved(), "0");
}

// The vocabulary's names (--manager_address, $KVCM_MANAGER_ADDRESS, --num_layers...) and the
// old ones (--addr, --layers...), which work the same and warn once each.
TEST_F(KvcmctlProcessTest, ManagerAddressAndDeprecatedNames) {
  ASSERT_NO_FATAL_FAILURE(StartManager());
  const std::string address = absl::StrCat("127.0.0.1:", port_);
  const std::vector<std::string> spec_new = {
      "--attention=gqa", "--num_layers=2", "--num_heads=8",        "--num_kv_heads=2",
      "--head_dim=4",    "--kv_dtype=fp8", "--page_size_tokens=16"};
  const std::vector<std::string> spec_old = {"--attention=gqa", "--layers=2",   "--heads=8",
                                             "--kv_heads=2",    "--head_dim=4", "--dtype=fp8",
                                             "--page_size=16"};
  EXPECT_THAT(CtlOk(With({"register-model"}, With(kNs, spec_new))), HasSubstr("(created)"));
  const std::string with_new = CtlOk(With({"register-model"}, With(kNs, spec_new)));
  ProcessResult old =
      CtlEnv({}, With({"--addr=" + address, "--addr=" + address, "--insecure", "register-model"},
                      With(kNs, spec_old)));
  EXPECT_EQ(old.exit_code, 0) << old.Describe();
  EXPECT_EQ(old.out, with_new);
  for (const char* line : {"kvcmctl: --addr is deprecated; use --manager_address\n",
                           "kvcmctl: --layers is deprecated; use --num_layers\n",
                           "kvcmctl: --heads is deprecated; use --num_heads\n",
                           "kvcmctl: --kv_heads is deprecated; use --num_kv_heads\n",
                           "kvcmctl: --dtype is deprecated; use --kv_dtype\n",
                           "kvcmctl: --page_size is deprecated; use --page_size_tokens\n"}) {
    EXPECT_THAT(old.err, HasSubstr(line));
  }
  EXPECT_EQ(old.err.find("--addr is"), old.err.rfind("--addr is")) << "warned twice: " << old.err;

  // --token still works, with a warning that ps shows it.
  ProcessResult token = Ctl({"--token=visible-token", "stats"});
  EXPECT_EQ(token.exit_code, 0) << token.Describe();
  EXPECT_THAT(token.err, HasSubstr("kvcmctl: --token is visible to every user in ps"));

  // $KVCM_MANAGER_ADDRESS without the flag; the flag over it.
  ProcessResult env = CtlEnv({"KVCM_MANAGER_ADDRESS=" + address}, {"--insecure", "stats"});
  EXPECT_EQ(env.exit_code, 0) << env.Describe();
  EXPECT_THAT(env.out, HasSubstr(address));
  ProcessResult flag_wins = CtlEnv({"KVCM_MANAGER_ADDRESS=127.0.0.1:1"},
                                   {"--insecure", "--manager_address=" + address, "stats"});
  EXPECT_EQ(flag_wins.exit_code, 0) << flag_wins.Describe();
  ProcessResult no_port = CtlEnv({"KVCM_MANAGER_ADDRESS=kvcm"}, {"--insecure", "stats"});
  EXPECT_EQ(no_port.exit_code, 2) << no_port.Describe();
  EXPECT_THAT(no_port.err, HasSubstr("KVCM_MANAGER_ADDRESS 'kvcm' has no port; the manager "
                                     "listens on 50051 by default: kvcm:50051"));
  // The old flag without a port: the warning, then the error under the new name; no call.
  ProcessResult old_no_port = CtlEnv({}, {"--addr=localhost", "--insecure", "match", "--pin",
                                          "--tenant=acme", "--model=deepseek-v3", "--tokens=1"});
  EXPECT_EQ(old_no_port.exit_code, 2) << old_no_port.Describe();
  EXPECT_THAT(old_no_port.err, HasSubstr("--addr is deprecated"));
  EXPECT_THAT(old_no_port.err, HasSubstr("--manager_address 'localhost' has no port"));
  EXPECT_EQ(JsonField(CtlOk({"--json", "stats"}), "pins_taken"), "0");
}

// A TLS kvcmctl against a plaintext manager: UNAVAILABLE with a line naming the likely fix.
TEST_F(KvcmctlProcessTest, TlsAgainstAPlaintextManagerHints) {
  absl::StatusOr<std::unique_ptr<TestCerts>> made = TestCerts::Make();
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_NO_FATAL_FAILURE(StartManager());
  ProcessResult r = CtlWith(
      {absl::StrCat("--tls_ca_file=", (*made)->Path("ca.pem")), "--deadline_ms=1000"}, {"stats"});
  EXPECT_EQ(r.exit_code, 1) << r.Describe();
  EXPECT_THAT(r.err, HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(r.err, HasSubstr("\nhint: the manager may be plaintext: pass --insecure"));
}

// agent-stats and lookup-agent against real kvcm-agent processes (host backend), and insert
// and fetch through them with --json.
TEST_F(KvcmctlProcessTest, AgentStatsAndLookupAgent) {
  ASSERT_NO_FATAL_FAILURE(StartManager());
  std::vector<std::unique_ptr<Subprocess>> agents;
  for (const char* id : {"gpu0", "gpu1"}) {
    agents.push_back(Subprocess::Start(
        {KVCM_AGENT_PATH, "--insecure", absl::StrCat("--agent_id=", id),
         absl::StrCat("--manager_address=127.0.0.1:", port_), "--listen_address=127.0.0.1:0",
         "--model=deepseek-v3", "--capacity_bytes=50000000", "--heartbeat_interval_ms=100"},
        absl::StrCat(log_path_, ".", id)));
    ASSERT_NE(agents.back(), nullptr);
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  std::string stats;
  while (absl::Now() < give_up) {
    stats = CtlOk({"stats"});
    if (testing::Value(stats, testing::ContainsRegex("gpu0 +[^ ]+ +gpu +alive")) &&
        testing::Value(stats, testing::ContainsRegex("gpu1 +[^ ]+ +gpu +alive"))) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_THAT(stats, testing::ContainsRegex("gpu1 +[^ ]+ +gpu +alive"))
      << ReadFile(log_path_ + ".gpu0") << ReadFile(log_path_ + ".gpu1");
  // Agents list in id order: the first address is gpu0's.
  const std::string block_agent_address =
      JsonField(CtlOk({"--json", "stats"}), "block_agent_address");
  ASSERT_FALSE(block_agent_address.empty());

  std::string out = CtlOk({"agent-stats", "--agent_id=gpu0"});
  EXPECT_THAT(out, HasSubstr("agent_id: gpu0\n"));
  EXPECT_THAT(out, HasSubstr("registered: true\n"));
  EXPECT_THAT(out, HasSubstr("address: " + block_agent_address + "\n"));
  out = CtlOk({"agent-stats", "--json", "--agent_address=" + block_agent_address});
  ExpectOneJsonObject(out);
  EXPECT_EQ(JsonField(out, "agent_id"), "gpu0") << out;
  EXPECT_NE(JsonField(out, "capacity_bytes"), "0") << out;

  CtlOk(With({"register-model", "--preset=deepseek-v3"}, kNs));
  out = CtlOk(With({"route", "--json", "--candidates=gpu0", "--random_tokens=300"}, kNs));
  ExpectOneJsonObject(out);
  EXPECT_EQ(JsonField(out, "agent_id"), "gpu0") << out;
  EXPECT_EQ(JsonField(out, "recompute_pages"), "4") << out;

  out = CtlOk({"lookup-agent", "--agent_id=gpu0"});
  EXPECT_THAT(out, testing::ContainsRegex("data_address: 127\\.0\\.0\\.1:[0-9]+\n"));
  out = CtlOk({"lookup-agent", "--json", "--agent_id=gpu0"});
  ExpectOneJsonObject(out);
  EXPECT_THAT(JsonField(out, "data_address"), testing::StartsWith("127.0.0.1:"));

  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"agent-stats", "--agent_id=nope"},
        std::vector<std::string>{"lookup-agent", "--agent_id=nope"},
        std::vector<std::string>{"forget-agent", "--agent_id=nope"}}) {
    ProcessResult r = Ctl(args);
    EXPECT_EQ(r.exit_code, 1) << r.Describe();
    EXPECT_THAT(r.err, HasSubstr("NOT_FOUND"));
    EXPECT_EQ(r.out, "");
  }
  // Plaintext against a TLS-less agent address that is not an agent: UNAVAILABLE, exit 1.
  ProcessResult gone = Ctl(
      {"--deadline_ms=300", "agent-stats", absl::StrCat("--agent_address=127.0.0.1:", FreePort())});
  EXPECT_EQ(gone.exit_code, 1) << gone.Describe();
  EXPECT_THAT(gone.err, HasSubstr("UNAVAILABLE"));

  // Insert through gpu0 (blocks allocated on it), then fetch into gpu1 from it.
  const std::vector<std::string> prompt = {"--random_tokens=300", "--seed=11"};
  out = CtlOk(With({"insert", "--json", "--agent=gpu0"}, With(kNs, prompt)));
  ExpectOneJsonObject(out);
  EXPECT_EQ(JsonField(out, "new_pages"), "4") << out;
  out = CtlOk(With({"fetch", "--json", "--agent=gpu1"}, With(kNs, prompt)));
  ExpectOneJsonObject(out);
  EXPECT_EQ(JsonField(out, "agent"), "gpu1") << out;
  EXPECT_EQ(JsonField(out, "fetched_pages"), "4") << out;
  EXPECT_EQ(JsonField(out, "bytes"), std::to_string(4 * 70'272 * 64)) << out;
  // forget-agent refuses a live agent unless forced, which changes nothing; forced, the agent
  // is forgotten (its next heartbeat answers NOT_FOUND and it registers again).
  ProcessResult live = Ctl({"forget-agent", "--agent_id=gpu1"});
  EXPECT_EQ(live.exit_code, 1) << live.Describe();
  EXPECT_THAT(live.err, HasSubstr("FAILED_PRECONDITION"));
  EXPECT_THAT(live.err, HasSubstr("force"));
  EXPECT_THAT(CtlOk({"stats"}), testing::ContainsRegex("gpu1 +[^ ]+ +gpu +alive"));
  out = CtlOk({"forget-agent", "--json", "--agent_id=gpu1", "--force"});
  ExpectOneJsonObject(out);
  EXPECT_EQ(JsonField(out, "was_alive"), "true") << out;
  EXPECT_NE(JsonField(out, "epoch"), "0") << out;

  for (const auto& agent : agents) {
    agent->Signal(SIGKILL);
    agent->Finish(absl::Seconds(10));
  }
  for (const char* id : {"gpu0", "gpu1"}) {
    std::remove(absl::StrCat(log_path_, ".", id).c_str());
  }
}

// Issue 33's repro with real processes: kvcmctl insert --agent (Allocate on the agent,
// WriteBlocks, Insert: README's worker flow) of 3-page prompts into an agent of 10 blocks.
// The fourth store used to answer RESOURCE_EXHAUSTED, and every later one; now each store
// makes room by evicting, and the pool stays full and exact.
TEST_F(KvcmctlProcessTest, InsertThroughAFullAgentEvicts) {
  ASSERT_NO_FATAL_FAILURE(StartManager());
  constexpr uint64_t kBlockBytes = 70'272 * 64;  // a DeepSeek-V3 page of 64 tokens
  std::unique_ptr<Subprocess> agent = Subprocess::Start(
      {KVCM_AGENT_PATH, "--insecure", "--agent_id=gpu0",
       absl::StrCat("--manager_address=127.0.0.1:", port_), "--listen_address=127.0.0.1:0",
       "--model=deepseek-v3", absl::StrCat("--capacity_bytes=", 10 * kBlockBytes),
       "--heartbeat_interval_ms=100"},
      log_path_ + ".gpu0");
  ASSERT_NE(agent, nullptr);
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (absl::Now() < give_up &&
         !testing::Value(CtlOk({"stats"}), testing::ContainsRegex("gpu0 +[^ ]+ +gpu +alive"))) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  CtlOk(With({"register-model", "--preset=deepseek-v3"}, kNs));
  for (int i = 0; i < 6; ++i) {
    ProcessResult r =
        Ctl(With({"insert", "--json", "--agent=gpu0"},
                 With(kNs, {"--random_tokens=192", absl::StrCat("--seed=", 40 + i)})));
    ASSERT_EQ(r.exit_code, 0) << "store " << i << ": " << r.Describe()
                              << ReadFile(log_path_ + ".gpu0");
    EXPECT_EQ(JsonField(r.out, "new_pages"), "3") << r.out;
  }
  // The latest prompt is cached; 18 pages went into 10 blocks.
  const std::string out =
      CtlOk(With({"match", "--json"}, With(kNs, {"--random_tokens=192", "--seed=45"})));
  EXPECT_EQ(JsonField(out, "matched_pages"), "3") << out;
  const std::string metrics = HttpGet(metrics_port_, "/metrics");
  EXPECT_THAT(metrics, testing::ContainsRegex("kvcm_allocation_evicted_pages_total [1-9]"));
  agent->Signal(SIGKILL);
  agent->Finish(absl::Seconds(10));
  std::remove((log_path_ + ".gpu0").c_str());
}

// A worker process killed mid-store (kvcmctl insert --agent stopped after its Allocate,
// while it writes, then SIGKILLed): its blocks are allocated and never committed nor freed.
// The agent frees them after --allocation_ttl_ms, so nothing leaks, and the pool serves
// stores again.
TEST_F(KvcmctlProcessTest, AWorkerKilledMidStoreLeaksNothing) {
  ASSERT_NO_FATAL_FAILURE(StartManager());
  // A small MLA geometry (4 layers: 295 KB pages) so that the store is long enough to catch
  // and the pool small.
  const std::vector<std::string> geometry = {
      "--attention=mla", "--num_layers=4",  "--num_heads=16",       "--kv_lora_rank=512",
      "--rope_dim=64",   "--kv_dtype=bf16", "--page_size_tokens=64"};
  constexpr uint64_t kBlocks = 1100;
  constexpr uint64_t kPages = 1000;
  constexpr uint64_t kBlockBytes = 1152 * 4 * 64;
  std::vector<std::string> agent_argv = {KVCM_AGENT_PATH,
                                         "--insecure",
                                         "--agent_id=gpu0",
                                         absl::StrCat("--manager_address=127.0.0.1:", port_),
                                         "--listen_address=127.0.0.1:0",
                                         "--model=",
                                         absl::StrCat("--capacity_bytes=", kBlocks * kBlockBytes),
                                         "--heartbeat_interval_ms=100",
                                         "--allocation_ttl_ms=1000"};
  agent_argv.insert(agent_argv.end(), geometry.begin(), geometry.end());
  std::unique_ptr<Subprocess> agent = Subprocess::Start(agent_argv, log_path_ + ".gpu0");
  ASSERT_NE(agent, nullptr);
  auto free_blocks = [&] {
    ProcessResult r = Ctl({"agent-stats", "--json", "--agent_id=gpu0"});
    uint64_t n = 0;
    return r.exit_code == 0 && absl::SimpleAtoi(JsonField(r.out, "free_blocks"), &n) ? n : 0;
  };
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (absl::Now() < give_up && free_blocks() != kBlocks) absl::SleepFor(absl::Milliseconds(50));
  ASSERT_EQ(free_blocks(), kBlocks) << ReadFile(log_path_ + ".gpu0");
  CtlOk(With({"register-model"}, With(kNs, geometry)));

  // Kill the worker after a delay, several times over the ~0.1-0.5 s its store takes: it
  // dies before its Allocate, while it writes, or after its Insert. Whichever, once the
  // ttl has passed, every block is free or indexed; at least one try must catch it with
  // its blocks allocated and not indexed (the case the ttl exists for).
  int caught = 0;
  for (int attempt = 0; attempt < 8 && caught < 2; ++attempt) {
    const std::vector<std::string> prompt = {absl::StrCat("--random_tokens=", kPages * 64),
                                             absl::StrCat("--seed=", 500 + attempt)};
    std::unique_ptr<Subprocess> worker = Subprocess::Start(
        With({KVCMCTL_PATH, "--insecure", absl::StrCat("--manager_address=127.0.0.1:", port_),
              "insert", "--agent=gpu0"},
             With(kNs, prompt)));
    ASSERT_NE(worker, nullptr);
    absl::SleepFor(absl::Milliseconds(40 + 40 * attempt));
    worker->Signal(SIGKILL);
    worker->Finish(absl::Seconds(10));
    uint64_t matched = 0;
    ASSERT_TRUE(absl::SimpleAtoi(
        JsonField(CtlOk(With({"match", "--json"}, With(kNs, prompt))), "matched_pages"), &matched));
    const uint64_t free_now = free_blocks();
    if (free_now + matched < kBlocks) ++caught;  // blocks allocated, not indexed
    // Reaped within the ttl plus a heartbeat or two (an indexed store's blocks are the
    // cache's and stay).
    const absl::Time reaped_by = absl::Now() + absl::Seconds(10);
    while (absl::Now() < reaped_by && free_blocks() + matched != kBlocks) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    ASSERT_EQ(free_blocks() + matched, kBlocks)
        << "attempt " << attempt << ": a dead worker's blocks leaked"
        << ReadFile(log_path_ + ".gpu0");
    // Start the next try empty.
    if (matched > 0) {
      CtlOk(With({"delete-namespace"}, kNs));
      CtlOk(With({"register-model"}, With(kNs, geometry)));
      const absl::Time freed_by = absl::Now() + absl::Seconds(10);
      while (absl::Now() < freed_by && free_blocks() != kBlocks) {
        absl::SleepFor(absl::Milliseconds(50));
      }
    }
  }
  EXPECT_GT(caught, 0) << "no try killed the worker between its Allocate and its Insert";
  EXPECT_THAT(ReadFile(log_path_ + ".gpu0"), HasSubstr("blocks allocated over allocation_ttl_ms"));
  // And a store goes through again.
  const std::string out = CtlOk(
      With({"insert", "--json", "--agent=gpu0"}, With(kNs, {"--random_tokens=192", "--seed=3"})));
  EXPECT_EQ(JsonField(out, "new_pages"), "3") << out;
  agent->Signal(SIGKILL);
  agent->Finish(absl::Seconds(10));
  std::remove((log_path_ + ".gpu0").c_str());
}

// 'models' prints the catalogue without a manager; 'register-model --preset' sends a
// catalogue spec, which the manager charges as the hand-computed bytes say.
TEST_F(KvcmctlProcessTest, ModelCatalogueOfflineAndAsPreset) {
  port_ = FreePort();  // nothing listens there
  std::string out = CtlOk({"models"});
  EXPECT_THAT(out, HasSubstr("deepseek-v3"));
  EXPECT_THAT(out, HasSubstr("70272"));
  // bf16: 1,152 B/token/layer, 70,272 B/token, * 64 = 4,497,408 B/page,
  // floor(2^30 / 70,272) = 15,279 tokens/GiB, 81,920 / 1,152 = 71.1x MHA-shaped.
  EXPECT_THAT(out, testing::ContainsRegex(
                       "deepseek-v3 +mla +61 +bf16 +1152 +70272 +4497408 +15279 +71\\.1x\n"));
  EXPECT_THAT(out, testing::ContainsRegex("llama-3-70b +gqa +80 +bf16 +4096 +327680 .* -\n"));
  EXPECT_THAT(out, Not(HasSubstr(" fp8 ")));
  out = CtlOk({"models", "--kv_dtype=all", "--page_size_tokens=16"});
  // FP8 MLA: 656 B/token/layer * 61 = 40,016 B/token, * 16 = 640,256 B/page.
  EXPECT_THAT(out, testing::ContainsRegex("deepseek-v3 +mla +61 +fp8 +656 +40016 +640256 "));
  EXPECT_THAT(out, testing::ContainsRegex("llama-3-8b +gqa +32 +int8 +2112 +67584 "));
  // --json: one object, the same numbers.
  out = CtlOk({"models", "--json", "--kv_dtype=fp8", "--page_size_tokens=16"});
  ExpectOneJsonObject(out);
  EXPECT_THAT(out, HasSubstr("{\"page_size_tokens\":16,\"models\":[{\"name\":\"deepseek-v3\""));
  EXPECT_THAT(out, HasSubstr("\"kv_dtype\":\"fp8\",\"bytes_per_token_per_layer\":656,"
                             "\"bytes_per_token\":40016,\"bytes_per_page\":640256,"));

  ASSERT_NO_FATAL_FAILURE(StartManager());
  out = CtlOk(With({"register-model", "--preset=deepseek-v3"}, kNs));
  EXPECT_THAT(out, HasSubstr("(created)"));
  EXPECT_EQ(Field(out, "bytes_per_token"), 70'272u) << out;
  // Explicit flags override the preset: Llama-3-70B in fp8 is 2 * 8 * 128 * 1 B * 80 layers
  // = 163,840 B/token; 16-token pages.
  out = CtlOk({"register-model", "--tenant=acme", "--model=llama", "--preset=llama-3-70b",
               "--kv_dtype=fp8", "--page_size_tokens=16"});
  EXPECT_EQ(Field(out, "bytes_per_token"), 163'840u) << out;
  EXPECT_EQ(Field(out, "bytes_per_page"), 163'840u * 16) << out;
}

// register-model --max_page_age_s sets the namespace's retention limit, which only
// tightens; stats shows it; a limit past 10 years is refused with the field named.
TEST_F(KvcmctlProcessTest, RegisterModelSetsARetentionLimit) {
  ASSERT_NO_FATAL_FAILURE(StartManager());
  std::string out = CtlOk(With({"register-model", "--preset=deepseek-v3"}, kNs));
  EXPECT_THAT(out, HasSubstr("max_page_age_s: none"));
  out = CtlOk(With({"register-model", "--preset=deepseek-v3", "--max_page_age_s=600"}, kNs));
  EXPECT_EQ(Field(out, "max_page_age_s"), 600u) << out;
  out = CtlOk(With({"register-model", "--preset=deepseek-v3", "--max_page_age_s=900"}, kNs));
  EXPECT_EQ(Field(out, "max_page_age_s"), 600u) << "a longer limit must not loosen it: " << out;
  out = CtlOk({"stats"});
  EXPECT_THAT(out, HasSubstr("MAX_AGE_S"));
  EXPECT_THAT(out, testing::ContainsRegex(" 600 +0\n"));
  EXPECT_THAT(out, HasSubstr("expired_pages"));
  ProcessResult absurd =
      Ctl(With({"register-model", "--preset=deepseek-v3", "--max_page_age_s=400000000"}, kNs));
  EXPECT_NE(absurd.exit_code, 0) << absurd.Describe();
  EXPECT_THAT(absurd.err, HasSubstr("max_page_age_s"));
  EXPECT_THAT(absurd.err, HasSubstr("INVALID_ARGUMENT"));
}

// These need no manager: usage errors are caught before any call.
TEST_F(KvcmctlProcessTest, UsageErrorsExitTwoWithAMessage) {
  port_ = FreePort();
  ProcessResult help = Ctl({"--help"});
  EXPECT_EQ(help.exit_code, 0) << help.Describe();
  for (const char* command :
       {"stats", "register-model", "match", "insert", "release", "evict", "watch", "models",
        "reserve", "unreserve", "agent-stats", "lookup-agent", "route", "fetch", "renew",
        "delete-namespace", "forget-agent"}) {
    EXPECT_THAT(help.out, HasSubstr(absl::StrCat("  ", command, " "))) << command;
    ProcessResult sub = Ctl({command, "--help"});
    EXPECT_EQ(sub.exit_code, 0) << sub.Describe();
    EXPECT_THAT(sub.out, HasSubstr("Flags:")) << command;
  }
  ProcessResult reg_help = Ctl({"register-model", "--help"});
  for (const char* flag :
       {"--tenant", "--model", "--preset", "--attention", "--num_layers", "--num_heads",
        "--num_kv_heads", "--head_dim", "--kv_lora_rank", "--rope_dim", "--kv_dtype",
        "--page_size_tokens", "--max_page_age_s", "--layers (--num_layers)"}) {
    EXPECT_THAT(reg_help.out, HasSubstr(flag));
  }

  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{}, "no command given"},
      {{"frobnicate"}, "unknown command 'frobnicate'"},
      {{"--bogus", "stats"}, "unknown flag --bogus"},
      {{"stats", "--bogus=1"}, "unknown flag --bogus"},
      {{"match", "--tenant=a", "--tokens=1,2"}, "--model is required"},
      {{"match", "--tenant=a", "--model=b"}, "exactly one of --tokens"},
      {{"match", "--tenant=a", "--model=b", "--tokens=1,x"}, "token 'x'"},
      {{"insert", "--tenant=a", "--model=b", "--tokens=1", "--agent=g", "--tier=ssd"}, "--tier"},
      {{"register-model", "--tenant=a", "--model=b", "--attention=rnn"}, "--attention"},
      {{"register-model", "--tenant=a", "--model=b", "--num_layers=-1"}, "--num_layers"},
      {{"release", "--tenant=a", "--model=b"}, "--pin_id is required"},
      {{"evict", "--bytes=1"}, "either --agent"},
      {{"register-model", "--tenant=a", "--model=b", "--preset=gpt-5"}, "deepseek-v3"},
      {{"models", "--kv_dtype=fp4"}, "--kv_dtype: expected bf16|fp16|fp8|int8|all"},
      {{"models", "--page_size_tokens=0"}, "--page_size_tokens"},
      {{"reserve", "--agent=g"}, "--bytes is required and must be > 0"},
      {{"unreserve", "--agent=g", "--bytes=0"}, "--bytes is required and must be > 0"},
      {{"reserve", "--bytes=1"}, "--agent is required"},
      {{"reserve", "--agent=g", "--bytes=1", "--tier=ssd"}, "--tier"},
      {{"agent-stats"}, "one of --agent_address and --agent_id"},
      {{"agent-stats", "--agent_id=a", "--agent_address=h:1"}, "one of --agent_address"},
      {{"agent-stats", "--agent_address=gpu-0"},
       "--agent_address 'gpu-0' has no port; the agent listens on 50052 by default: gpu-0:50052"},
      {{"lookup-agent"}, "--agent_id is required"},
      {{"forget-agent", "--force"}, "--agent_id is required"},
      {{"--manager_address=localhost", "stats"},
       "--manager_address 'localhost' has no port; the manager listens on 50051 by default: "
       "localhost:50051"},
      {{"--manager_address=localhost:http", "stats"}, "port in 1..65535"},
  };
  for (const Case& c : cases) {
    ProcessResult r = Ctl(c.args);
    EXPECT_TRUE(r.exited) << r.Describe();
    EXPECT_EQ(r.exit_code, 2) << absl::StrJoin(c.args, " ") << ": " << r.Describe();
    EXPECT_THAT(r.err, HasSubstr(c.message)) << absl::StrJoin(c.args, " ");
    EXPECT_THAT(r.out, Not(HasSubstr("matched_pages")));
  }

  // A well-formed call with no manager listening fails with the gRPC code, and no TLS hint:
  // a refused connection is a manager that is down.
  ProcessResult down = Ctl({"--deadline_ms=300", "stats"});
  EXPECT_EQ(down.exit_code, 1) << down.Describe();
  EXPECT_THAT(down.err, HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(down.err, Not(HasSubstr("hint:")));

  // --version and --help exit 0 before anything is dialled.
  ProcessResult version = Ctl({"--version"});
  EXPECT_EQ(version.exit_code, 0) << version.Describe();
  EXPECT_THAT(version.out, testing::StartsWith("kvcmctl "));
  EXPECT_THAT(version.out, HasSubstr("(git "));
  EXPECT_THAT(help.out, HasSubstr("PublishEngineEvents"));  // why it is not a command
}

}  // namespace

namespace {

// The manager serving mutual TLS; kvcmctl with the CA and a client certificate (and a token
// file, which goes with every call) is served, and refused without any of them.
TEST_F(KvcmctlProcessTest, StatsOverMutualTlsAndWhatIsRefused) {
  absl::StatusOr<std::unique_ptr<TestCerts>> made = TestCerts::Make();
  ASSERT_TRUE(made.ok()) << made.status();
  const TestCerts& certs = **made;
  manager_security_ = {absl::StrCat("--tls_cert_file=", certs.Path("manager.pem")),
                       absl::StrCat("--tls_key_file=", certs.Path("manager.key")),
                       absl::StrCat("--tls_ca_file=", certs.Path("ca.pem"))};
  const std::string ca = absl::StrCat("--tls_ca_file=", certs.Path("ca.pem"));
  const std::string cert = absl::StrCat("--tls_cert_file=", certs.Path("client.pem"));
  const std::string key = absl::StrCat("--tls_key_file=", certs.Path("client.key"));
  ctl_security_ = {ca, cert, key};
  ASSERT_NO_FATAL_FAILURE(StartManager());
  EXPECT_THAT(CtlOk({"stats"}), HasSubstr("POOLS"));
  EXPECT_THAT(ReadFile(log_path_), HasSubstr("(mutual TLS;"));
  {
    std::ofstream(certs.Path("token")) << "operator-token\n";
    const std::string token_file = absl::StrCat("--token_file=", certs.Path("token"));
    ProcessResult r = CtlWith({ca, cert, key, token_file}, {"stats"});
    EXPECT_EQ(r.exit_code, 0) << r.Describe();
  }

  ProcessResult no_ca = CtlWith({}, {"stats"});
  EXPECT_EQ(no_ca.exit_code, 2) << no_ca.Describe();
  EXPECT_THAT(no_ca.err, HasSubstr("--tls_ca_file is required"));
  // Plaintext against TLS: UNAVAILABLE, with a line naming the likely fix.
  ProcessResult plaintext = CtlWith({"--insecure", "--deadline_ms=1000"}, {"stats"});
  EXPECT_EQ(plaintext.exit_code, 1) << plaintext.Describe();
  EXPECT_THAT(plaintext.err, HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(plaintext.err, HasSubstr("\nhint: the manager may require TLS: pass --tls_ca_file="));
  // The old flag names work, each warned about once.
  const std::string old_ca = absl::StrCat("--ca=", certs.Path("ca.pem"));
  ProcessResult old_names = CtlWith({old_ca, absl::StrCat("--cert=", certs.Path("client.pem")),
                                     absl::StrCat("--key=", certs.Path("client.key")), old_ca},
                                    {"stats"});
  EXPECT_EQ(old_names.exit_code, 0) << old_names.Describe();
  EXPECT_THAT(old_names.err, HasSubstr("kvcmctl: --ca is deprecated; use --tls_ca_file\n"));
  EXPECT_THAT(old_names.err, HasSubstr("kvcmctl: --cert is deprecated; use --tls_cert_file\n"));
  EXPECT_THAT(old_names.err, HasSubstr("kvcmctl: --key is deprecated; use --tls_key_file\n"));
  EXPECT_EQ(old_names.err.find("--ca is"), old_names.err.rfind("--ca is")) << old_names.err;
  ProcessResult no_cert = CtlWith({ca, "--deadline_ms=1000"}, {"stats"});
  EXPECT_EQ(no_cert.exit_code, 1) << no_cert.Describe();
  EXPECT_THAT(no_cert.err, HasSubstr("UNAVAILABLE"));
  ProcessResult stranger =
      CtlWith({ca, absl::StrCat("--tls_cert_file=", certs.Path("untrusted.pem")),
               absl::StrCat("--tls_key_file=", certs.Path("untrusted.key")), "--deadline_ms=1000"},
              {"stats"});
  EXPECT_EQ(stranger.exit_code, 1) << stranger.Describe();
  ProcessResult missing =
      CtlWith({absl::StrCat("--tls_ca_file=", certs.Path("nope.pem"))}, {"stats"});
  EXPECT_EQ(missing.exit_code, 2) << missing.Describe();
  EXPECT_THAT(missing.err, HasSubstr(certs.Path("nope.pem")));
}

TEST_F(KvcmctlProcessTest, AManagerWithoutTransportSecurityOrWithAMissingFileDoesNotStart) {
  std::unique_ptr<Subprocess> none =
      Subprocess::Start({KVCM_MANAGER_PATH, "--listen_address=127.0.0.1:0", "--metrics_address="});
  ASSERT_NE(none, nullptr);
  ProcessResult r = none->Finish(absl::Seconds(15));
  EXPECT_TRUE(r.exited && r.exit_code == 1) << r.Describe();
  EXPECT_THAT(r.err, HasSubstr("pass --tls_cert_file and --tls_key_file"));
  EXPECT_THAT(r.err, HasSubstr("or --insecure"));

  std::unique_ptr<Subprocess> missing =
      Subprocess::Start({KVCM_MANAGER_PATH, "--listen_address=127.0.0.1:0",
                         "--metrics_address=", "--tls_cert_file=/nonexistent/m.pem",
                         "--tls_key_file=/nonexistent/m.key"});
  ASSERT_NE(missing, nullptr);
  r = missing->Finish(absl::Seconds(15));
  EXPECT_TRUE(r.exited && r.exit_code == 1) << r.Describe();
  EXPECT_THAT(r.err, HasSubstr("tls_cert_file \"/nonexistent/m.pem\": cannot open"));

  // --insecure starts, and says loudly what it means.
  std::unique_ptr<Subprocess> insecure = Subprocess::Start(
      {KVCM_MANAGER_PATH, "--insecure", "--listen_address=127.0.0.1:0", "--metrics_address="});
  ASSERT_NE(insecure, nullptr);
  absl::SleepFor(absl::Milliseconds(500));
  insecure->Signal(SIGTERM);
  r = insecure->Finish(absl::Seconds(15));
  EXPECT_TRUE(r.exited && r.exit_code == 0) << r.Describe();
  EXPECT_THAT(r.err, HasSubstr("WARNING: insecure = true"));
  EXPECT_THAT(r.out, HasSubstr("PLAINTEXT"));
}

}  // namespace
