#include "tests/util/test_certs.h"

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace kvcm::testing {

absl::StatusOr<std::unique_ptr<TestCerts>> TestCerts::Make(
    const std::vector<std::string>& agent_ids) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/kvcm_certs_XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", pattern, " failed"));
  }
  std::unique_ptr<TestCerts> certs(new TestCerts(pattern));
  std::string command = absl::StrCat("'", KVCM_MAKE_TEST_CERTS, "' '", pattern, "'");
  for (const std::string& id : agent_ids) absl::StrAppend(&command, " '", id, "'");
  absl::StrAppend(&command, " >/dev/null");
  if (const int rc = std::system(command.c_str()); rc != 0) {
    return absl::InternalError(absl::StrCat(command, " failed with status ", rc));
  }
  return certs;
}

TestCerts::~TestCerts() {
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

TlsOptions TestCerts::Identity(const std::string& name, const std::string& ca) const {
  return TlsOptions{.cert_file = Path(name + ".pem"),
                    .key_file = Path(name + ".key"),
                    .ca_file = Path(ca + ".pem"),
                    .reload_interval_s = 1};
}

TlsOptions TestCerts::TrustOnly(const std::string& ca) const {
  return TlsOptions{.ca_file = Path(ca + ".pem"), .reload_interval_s = 1};
}

absl::Status TestCerts::ReplaceFile(const std::string& to, const std::string& from) const {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path staged = Path(to + ".new");
  fs::copy_file(Path(from), staged, fs::copy_options::overwrite_existing, error);
  if (!error) {
    fs::last_write_time(staged, fs::last_write_time(staged) + std::chrono::seconds(1), error);
  }
  if (!error) fs::rename(staged, Path(to), error);
  if (error) return absl::InternalError(absl::StrCat("replace ", to, ": ", error.message()));
  return absl::OkStatus();
}

absl::Status TestCerts::Replace(const std::string& name, const std::string& from) const {
  if (absl::Status s = ReplaceFile(name + ".key", from + ".key"); !s.ok()) return s;
  return ReplaceFile(name + ".pem", from + ".pem");
}

}  // namespace kvcm::testing
