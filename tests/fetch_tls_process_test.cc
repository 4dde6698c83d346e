// Fetch with mutual TLS and tokens on, as processes: README's secured set-up (a kvcm-manager
// and two kvcm-agents with certificates of one CA, a tokens file on all three), driven by
// kvcmctl as each principal would run it. The destination agent indexes what it pulled with
// its own Insert, as itself (role agent, its own pool only): the pages are local to it
// afterwards. Another tenant's worker fetches nothing into the tenant's namespace, and a
// Fetch naming an agent the manager does not know dials nothing.
#include <unistd.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/token_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/child_process.h"
#include "tests/util/test_certs.h"

namespace kvcm {
namespace {

using ::kvcm::testing::FreePort;
using ::kvcm::testing::OutputField;
using ::kvcm::testing::ProcessResult;
using ::kvcm::testing::ReadFile;
using ::kvcm::testing::Subprocess;
using ::kvcm::testing::TestCerts;
using ::kvcm::testing::WaitUntil;
using ::testing::HasSubstr;

const std::vector<std::string> kAgents = {"gpu-a", "gpu-b"};
// Bearer tokens, one file each; the manager's and agents' tokens file holds their hashes.
const std::map<std::string, std::string> kTokens = {
    {"acme", "acme-worker-token-19c2f0"},  {"evil", "evil-worker-token-6b0d3e"},
    {"gpu-a", "gpu-a-agent-token-58e7a1"}, {"gpu-b", "gpu-b-agent-token-0f4c92"},
    {"ops", "ops-admin-token-a7d310"},
};
const char kPrompt[] = "--random_tokens=300";  // 4 whole pages of deepseek-v3 (64 tokens)

void WriteFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr) << path;
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

class FetchTlsProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestCerts>> certs = TestCerts::Make(kAgents);
    ASSERT_TRUE(certs.ok()) << certs.status();
    certs_ = *std::move(certs);
    for (const auto& [who, token] : kTokens) WriteFile(Path(who + ".token"), token);
    WriteFile(Path("tokens"),
              absl::StrCat(Sha256Hex(kTokens.at("acme")), " acme-vllm roles=worker tenant=acme\n",
                           Sha256Hex(kTokens.at("evil")), " evil-vllm roles=worker tenant=evil\n",
                           Sha256Hex(kTokens.at("gpu-a")), " gpu-a roles=agent agent=gpu-a\n",
                           Sha256Hex(kTokens.at("gpu-b")), " gpu-b roles=agent agent=gpu-b\n",
                           Sha256Hex(kTokens.at("ops")), " ops roles=admin\n"));
    WriteFile(Path("hash_secret"), "000102030405060708090a0b0c0d0e0f\n");

    address_ = absl::StrCat("127.0.0.1:", FreePort());
    Spawn("manager", {KVCM_MANAGER_PATH, absl::StrCat("--listen_address=", address_),
                      "--metrics_address=", "--shutdown_grace_ms=500",
                      absl::StrCat("--tls_cert_file=", Path("manager.pem")),
                      absl::StrCat("--tls_key_file=", Path("manager.key")),
                      absl::StrCat("--tls_ca_file=", Path("ca.pem")),
                      absl::StrCat("--tokens_file=", Path("tokens")),
                      absl::StrCat("--hash_secret_file=", Path("hash_secret"))});
    for (const std::string& id : kAgents) {
      Spawn(id, {KVCM_AGENT_PATH, absl::StrCat("--agent_id=", id),
                 absl::StrCat("--manager_address=", address_), "--listen_address=127.0.0.1:0",
                 "--data_listen_address=127.0.0.1:0",
                 absl::StrCat("--tls_cert_file=", Path(id + ".pem")),
                 absl::StrCat("--tls_key_file=", Path(id + ".key")),
                 absl::StrCat("--tls_ca_file=", Path("ca.pem")),
                 absl::StrCat("--token_file=", Path(id + ".token")),
                 absl::StrCat("--tokens_file=", Path("tokens")), "--model=deepseek-v3",
                 "--capacity_bytes=100000000", "--heartbeat_interval_ms=100"});
    }
    ASSERT_TRUE(WaitUntil(
        [&] {
          const ProcessResult r = Ctl("ops", {"--deadline_ms=500", "stats"});
          std::vector<std::string> alive;
          for (absl::string_view line : absl::StrSplit(r.out, '\n')) {
            if (absl::StrContains(line, " alive ")) alive.emplace_back(line);
          }
          return alive.size() == kAgents.size();
        },
        absl::Seconds(20)))
        << "the agents did not register within 20 s";
    for (const char* tenant : {"acme", "evil"}) {
      const ProcessResult r = Ctl(tenant, {"register-model", absl::StrCat("--tenant=", tenant),
                                           "--model=deepseek-v3", "--preset=deepseek-v3"});
      ASSERT_EQ(r.exit_code, 0) << r.Describe();
    }
  }

  void TearDown() override {
    for (auto& [name, p] : processes_) {
      p->Signal(SIGKILL);
      p->Finish(absl::Seconds(10));
      if (HasFailure()) {
        std::fprintf(stderr, "--- %s ---\n%s\n", name.c_str(), ReadFile(LogPath(name)).c_str());
      }
      std::remove(LogPath(name).c_str());
    }
  }

  std::string Path(const std::string& file) const { return certs_->Path(file); }
  std::string LogPath(const std::string& name) const { return Path(name + ".log"); }

  void Spawn(const std::string& name, const std::vector<std::string>& argv) {
    std::unique_ptr<Subprocess> p = Subprocess::Start(argv, LogPath(name));
    ASSERT_NE(p, nullptr) << name;
    processes_[name] = std::move(p);
  }

  // kvcmctl over mutual TLS with `who`'s token.
  ProcessResult Ctl(const std::string& who, std::vector<std::string> args) {
    args.insert(args.begin(), {KVCMCTL_PATH, absl::StrCat("--manager_address=", address_),
                               absl::StrCat("--tls_ca_file=", Path("ca.pem")),
                               absl::StrCat("--tls_cert_file=", Path("client.pem")),
                               absl::StrCat("--tls_key_file=", Path("client.key")),
                               absl::StrCat("--token_file=", Path(who + ".token"))});
    std::unique_ptr<Subprocess> p = Subprocess::Start(args);
    return p == nullptr ? ProcessResult{} : p->Finish(absl::Seconds(30));
  }

  std::unique_ptr<TestCerts> certs_;
  std::string address_;
  std::map<std::string, std::unique_ptr<Subprocess>> processes_;
};

TEST_F(FetchTlsProcessTest, KvcmctlFetchIndexesThePagesOnTheDestination) {
  ProcessResult r =
      Ctl("acme", {"insert", "--tenant=acme", "--model=deepseek-v3", kPrompt, "--agent=gpu-a"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  ASSERT_EQ(OutputField(r.out, "new_pages"), "4") << r.out;
  r = Ctl("acme", {"match", "--tenant=acme", "--model=deepseek-v3", kPrompt, "--agent=gpu-b"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_EQ(OutputField(r.out, "local_pages"), "0") << r.out;

  // Another tenant's worker: acme's namespace is not one it can see, nothing is pulled.
  r = Ctl("evil", {"fetch", "--tenant=acme", "--model=deepseek-v3", kPrompt, "--agent=gpu-b"});
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  EXPECT_THAT(r.err, HasSubstr("NOT_FOUND: namespace acme/deepseek-v3 is not registered"))
      << r.Describe();
  r = Ctl("acme", {"match", "--tenant=acme", "--model=deepseek-v3", kPrompt, "--agent=gpu-b"});
  EXPECT_EQ(OutputField(r.out, "local_pages"), "0") << r.out;

  r = Ctl("acme", {"fetch", "--tenant=acme", "--model=deepseek-v3", kPrompt, "--agent=gpu-b"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_EQ(OutputField(r.out, "fetched_pages"), "4") << r.out;
  EXPECT_THAT(r.out, HasSubstr("from gpu-a:gpu pages [0, 4)")) << r.out;

  // Indexed on the destination: its own replica, and the source's still there.
  r = Ctl("acme", {"match", "--tenant=acme", "--model=deepseek-v3", kPrompt, "--agent=gpu-b"});
  ASSERT_EQ(r.exit_code, 0) << r.Describe();
  EXPECT_EQ(OutputField(r.out, "local_pages"), "4") << r.out;
  EXPECT_THAT(r.out, HasSubstr("gpu-b:gpu blocks")) << r.out;
  EXPECT_THAT(r.out, HasSubstr("gpu-a:gpu blocks")) << r.out;
  r = Ctl("acme", {"fetch", "--tenant=acme", "--model=deepseek-v3", kPrompt, "--agent=gpu-b"});
  EXPECT_THAT(r.err, HasSubstr("ALREADY_EXISTS")) << r.Describe();
}

}  // namespace
}  // namespace kvcm
