#include "client/tls_hint.h"

#include <initializer_list>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvcm {
namespace {

// Whether `text` contains any of `needles` (lower case), ignoring case.
bool ContainsAny(absl::string_view text, std::initializer_list<absl::string_view> needles) {
  const std::string lower = absl::AsciiStrToLower(text);
  for (absl::string_view needle : needles) {
    if (absl::StrContains(lower, needle)) return true;
  }
  return false;
}

}  // namespace

std::string TlsMismatchHint(const absl::Status& status, bool insecure, absl::string_view server) {
  if (status.code() != absl::StatusCode::kUnavailable) return "";
  const absl::string_view text = status.message();
  if (insecure) {
    // A TLS server drops a plaintext HTTP/2 preface: the client sees the socket close.
    if (ContainsAny(text, {"socket closed", "connection reset", "handshake", "end of file",
                           "connection closed", "goaway", "ssl", "tls"})) {
      return absl::StrCat("hint: ", server,
                          " may require TLS: pass --tls_ca_file=<its CA bundle> (and "
                          "--tls_cert_file/--tls_key_file for mutual TLS) instead of --insecure");
    }
    return "";
  }
  if (ContainsAny(text, {"ssl", "handshake", "wrong_version_number", "tls", "socket closed",
                         "certificate"})) {
    return absl::StrCat("hint: ", server,
                        " may be plaintext: pass --insecure if it was started with --insecure; "
                        "else check --tls_ca_file, and --tls_cert_file/--tls_key_file if it "
                        "requires a client certificate");
  }
  return "";
}

absl::Status WithTlsMismatchHint(absl::Status status, bool insecure, absl::string_view server) {
  const std::string hint = TlsMismatchHint(status, insecure, server);
  if (hint.empty()) return status;
  return absl::Status(status.code(), absl::StrCat(status.message(), "\n", hint));
}

}  // namespace kvcm
