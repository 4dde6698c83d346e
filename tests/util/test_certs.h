// Throw-away TLS certificates for tests: scripts/make_test_certs.sh (Debian's openssl CLI)
// run into a fresh temporary directory that is removed with the TestCerts. Nothing is
// checked in. See the script for the files: ca, manager, one per agent id, client, and
// untrusted (signed by untrusted-ca, which nobody trusts). Test code; not thread-safe.
#ifndef KVCM_TESTS_UTIL_TEST_CERTS_H_
#define KVCM_TESTS_UTIL_TEST_CERTS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/credentials.h"

namespace kvcm::testing {

class TestCerts {
 public:
  // Makes the certificates, with one identity per agent id. INTERNAL when the script fails.
  static absl::StatusOr<std::unique_ptr<TestCerts>> Make(
      const std::vector<std::string>& agent_ids = {"agent-0", "agent-1"});
  ~TestCerts();
  TestCerts(const TestCerts&) = delete;
  TestCerts& operator=(const TestCerts&) = delete;

  const std::string& dir() const { return dir_; }
  // dir()/file, e.g. Path("ca.pem").
  std::string Path(const std::string& file) const { return dir_ + "/" + file; }

  // Identity `name` (manager, client, an agent id, untrusted) trusting `ca` (ca or
  // untrusted-ca): <name>.pem, <name>.key and <ca>.pem, reloaded every second.
  TlsOptions Identity(const std::string& name, const std::string& ca = "ca") const;
  // Trust only (a channel without a client certificate).
  TlsOptions TrustOnly(const std::string& ca = "ca") const;

  // Overwrites identity `name`'s certificate and key with `from`'s, each renamed into place
  // (the way a rotation should be done), and its mtime set a second ahead, so a watcher that
  // compares contents or times sees the change.
  absl::Status Replace(const std::string& name, const std::string& from) const;
  // Copies file `from` over file `to` (both in dir()) by a rename.
  absl::Status ReplaceFile(const std::string& to, const std::string& from) const;

 private:
  explicit TestCerts(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

}  // namespace kvcm::testing

#endif  // KVCM_TESTS_UTIL_TEST_CERTS_H_
