// A real etcd (Debian's etcd-server) on free loopback ports in a temporary data directory,
// for tests of the managers' leader election. Header-only, test code.
//
// EtcdProcess::StartOrSkip() returns null when there is no etcd binary: the caller skips,
// unless KVCM_REQUIRE_ETCD=1 (scripts/test.sh), which makes that a failure.
#ifndef KVCM_TESTS_UTIL_ETCD_PROCESS_H_
#define KVCM_TESTS_UTIL_ETCD_PROCESS_H_

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/ha/etcd_client.h"
#include "tests/util/child_process.h"

namespace kvcm::testing {

class EtcdProcess {
 public:
  static std::string Binary() {
    for (const char* path : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
      if (access(path, X_OK) == 0) return path;
    }
    return "";
  }

  // Null when etcd is not installed (a failure too under KVCM_REQUIRE_ETCD=1) or did not
  // answer within 20 s (a failure).
  static std::unique_ptr<EtcdProcess> StartOrSkip() {
    const std::string binary = Binary();
    if (binary.empty()) {
      const char* require = std::getenv("KVCM_REQUIRE_ETCD");
      if (require != nullptr && std::string(require) == "1") {
        ADD_FAILURE() << "no etcd binary and KVCM_REQUIRE_ETCD=1 (apt-get install etcd-server)";
      }
      return nullptr;
    }
    auto e = std::unique_ptr<EtcdProcess>(new EtcdProcess());
    const char* tmp = std::getenv("TMPDIR");
    static int started = 0;
    e->dir_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/kvcm_etcd_", getpid(), "_", started++);
    std::filesystem::remove_all(e->dir_);
    std::filesystem::create_directories(e->dir_);
    e->endpoint_ = absl::StrCat("127.0.0.1:", FreePort());
    const std::string client_url = absl::StrCat("http://", e->endpoint_);
    const std::string peer_url = absl::StrCat("http://127.0.0.1:", FreePort());
    e->process_ = Subprocess::Start(
        {binary, "--name=kvcm-test", absl::StrCat("--data-dir=", e->dir_, "/data"),
         absl::StrCat("--listen-client-urls=", client_url),
         absl::StrCat("--advertise-client-urls=", client_url),
         absl::StrCat("--listen-peer-urls=", peer_url),
         absl::StrCat("--initial-advertise-peer-urls=", peer_url),
         absl::StrCat("--initial-cluster=kvcm-test=", peer_url)},
        e->log());
    if (e->process_ == nullptr) return nullptr;
    // etcd accepts connections before it serves them; a gRPC channel that connected then
    // waits out its connect timeout (seconds). So: its log says it serves, then a fresh
    // client per try.
    const bool up = WaitUntil(
        [&] {
          if (ReadFile(e->log()).find("ready to serve client requests") == std::string::npos) {
            return false;
          }
          absl::StatusOr<std::unique_ptr<EtcdClient>> client =
              EtcdClient::Create({e->endpoint_}, TlsOptions{.insecure = true});
          return client.ok() && (*client)->Get("/", absl::Now() + absl::Seconds(1)).ok();
        },
        absl::Seconds(20));
    if (!up) {
      ADD_FAILURE() << "etcd did not answer within 20 s:\n" << ReadFile(e->log());
      return nullptr;
    }
    return e;
  }

  ~EtcdProcess() {
    Kill();
    if (::testing::Test::HasFailure()) {
      std::fprintf(stderr, "--- etcd ---\n%s\n", ReadFile(log()).c_str());
    }
    std::filesystem::remove_all(dir_);
    std::remove(log().c_str());
  }

  // host:port of its client (gRPC) port.
  const std::string& endpoint() const { return endpoint_; }
  void Kill() {
    if (process_ == nullptr) return;
    process_->Signal(SIGKILL);
    process_->Finish(absl::Seconds(10));
    process_.reset();
  }
  // Freezes (SIGSTOP) or thaws (SIGCONT) it: a member that stops answering.
  void Pause(bool paused) {
    if (process_ != nullptr) process_->Signal(paused ? SIGSTOP : SIGCONT);
  }

 private:
  EtcdProcess() = default;
  std::string log() const { return absl::StrCat(dir_, ".log"); }

  std::string dir_;
  std::string endpoint_;
  std::unique_ptr<Subprocess> process_;
};

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_ETCD_PROCESS_H_
