#include "client/tls_hint.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

TEST(TlsMismatchHintTest, PlaintextAgainstTls) {
  const absl::Status closed = absl::UnavailableError(
      "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket "
      "closed");
  EXPECT_THAT(TlsMismatchHint(closed, /*insecure=*/true, "the manager"),
              HasSubstr("the manager may require TLS: pass --tls_ca_file="));
  absl::Status hinted = WithTlsMismatchHint(closed, true, "the manager");
  EXPECT_EQ(hinted.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(hinted.message(), HasSubstr("Socket closed\nhint: the manager may require TLS"));
}

TEST(TlsMismatchHintTest, TlsAgainstPlaintext) {
  const absl::Status ssl = absl::UnavailableError(
      "Ssl handshake failed: SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:"
      "WRONG_VERSION_NUMBER");
  EXPECT_THAT(TlsMismatchHint(ssl, /*insecure=*/false, "the agent"),
              HasSubstr("the agent may be plaintext: pass --insecure"));
}

TEST(TlsMismatchHintTest, NoHintForOtherFailures) {
  // A refused connection is a server that is down, not a mismatch.
  const absl::Status refused =
      absl::UnavailableError("failed to connect to all addresses; Connection refused");
  EXPECT_EQ(TlsMismatchHint(refused, true, "the manager"), "");
  EXPECT_EQ(TlsMismatchHint(refused, false, "the manager"), "");
  // Only UNAVAILABLE: an answer came, so the transports agree.
  EXPECT_EQ(TlsMismatchHint(absl::NotFoundError("Socket closed"), true, "the manager"), "");
  EXPECT_EQ(TlsMismatchHint(absl::OkStatus(), true, "the manager"), "");
  const absl::Status not_found = absl::NotFoundError("pin 3");
  EXPECT_EQ(WithTlsMismatchHint(not_found, true, "the manager"), not_found);
}

}  // namespace
}  // namespace kvcm
