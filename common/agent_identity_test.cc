#include "common/agent_identity.h"

#include <openssl/bio.h>
#include <openssl/ec.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

using ::testing::HasSubstr;

constexpr absl::string_view kSuffix = ".kvcm-agent.kvcm.svc";

// One subjectAltName: a GEN_* type and its value (for GEN_IPADD, the address's bytes).
struct San {
  int type;
  std::string value;
};

// A self-signed P-256 certificate of common name `cn`, with exactly `sans` as its
// subjectAltName extension (none when empty), as PEM. Values go in byte for byte, so a test
// can put a NUL in one.
std::string MakePem(const std::string& cn, const std::vector<San>& sans) {
  EVP_PKEY* key = nullptr;
  EVP_PKEY_CTX* kctx = EVP_PKEY_CTX_new_id(EVP_PKEY_EC, nullptr);
  EXPECT_EQ(EVP_PKEY_keygen_init(kctx), 1);
  EXPECT_EQ(EVP_PKEY_CTX_set_ec_paramgen_curve_nid(kctx, NID_X9_62_prime256v1), 1);
  EXPECT_EQ(EVP_PKEY_keygen(kctx, &key), 1);
  EVP_PKEY_CTX_free(kctx);
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert), 0);
  X509_gmtime_adj(X509_getm_notAfter(cert), 3600);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  X509_set_issuer_name(cert, name);
  if (!sans.empty()) {
    GENERAL_NAMES* names = sk_GENERAL_NAME_new_null();
    for (const San& san : sans) {
      ASN1_STRING* value = san.type == GEN_IPADD ? ASN1_OCTET_STRING_new() : ASN1_IA5STRING_new();
      ASN1_STRING_set(value, san.value.data(), static_cast<int>(san.value.size()));
      GENERAL_NAME* gn = GENERAL_NAME_new();
      GENERAL_NAME_set0_value(gn, san.type, value);
      sk_GENERAL_NAME_push(names, gn);
    }
    EXPECT_EQ(X509_add1_ext_i2d(cert, NID_subject_alt_name, names, 0, 0), 1);
    GENERAL_NAMES_free(names);
  }
  EXPECT_GT(X509_sign(cert, key, EVP_sha256()), 0);
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(bio, cert);
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio, &data);
  std::string pem(data, static_cast<size_t>(size));
  BIO_free(bio);
  X509_free(cert);
  EVP_PKEY_free(key);
  return pem;
}

std::optional<std::string> AgentOf(const std::vector<San>& sans, const std::string& cn = "x") {
  absl::StatusOr<std::optional<std::string>> name =
      AgentNameOfCertificate(MakePem(cn, sans), kSuffix);
  EXPECT_TRUE(name.ok()) << name.status();
  return name.ok() ? *name : std::nullopt;
}

TEST(AgentIdentityCertificateTest, OnlyDnsSubjectAltNamesAreRead) {
  const std::vector<San> sans = {{GEN_DNS, "localhost"},
                                 {GEN_URI, "pod-a.kvcm-agent.kvcm.svc"},
                                 {GEN_EMAIL, "pod-b.kvcm-agent.kvcm.svc"},
                                 {GEN_IPADD, std::string("\x7f\x00\x00\x01", 4)},
                                 {GEN_DNS, "pod-c.kvcm-agent.kvcm.svc"}};
  absl::StatusOr<std::vector<std::string>> dns = DnsSubjectAltNames(MakePem("cn", sans));
  ASSERT_TRUE(dns.ok()) << dns.status();
  EXPECT_THAT(*dns, ::testing::ElementsAre("localhost", "pod-c.kvcm-agent.kvcm.svc"));
  EXPECT_EQ(AgentOf(sans), "pod-c");
}

// The names an attacker would try, each alone in a certificate of the CA: none is an agent.
TEST(AgentIdentityCertificateTest, AUriEmailOrCommonNameIsNoAgent) {
  EXPECT_EQ(AgentOf({{GEN_URI, "pod-a.kvcm-agent.kvcm.svc"}}), std::nullopt);
  EXPECT_EQ(AgentOf({{GEN_URI, "spiffe://pod-a.kvcm-agent.kvcm.svc"}}), std::nullopt);
  EXPECT_EQ(AgentOf({{GEN_EMAIL, "pod-a.kvcm-agent.kvcm.svc"}}), std::nullopt);
  EXPECT_EQ(AgentOf({{GEN_EMAIL, "x@pod-a.kvcm-agent.kvcm.svc"}}), std::nullopt);
  EXPECT_EQ(AgentOf({}, "pod-a.kvcm-agent.kvcm.svc"), std::nullopt);
  EXPECT_EQ(AgentOf({{GEN_DNS, "localhost"}}, "pod-a.kvcm-agent.kvcm.svc"), std::nullopt);
  // A wildcard, two labels, a NUL byte: not one DNS label before the suffix.
  EXPECT_EQ(AgentOf({{GEN_DNS, "*.kvcm-agent.kvcm.svc"}}), std::nullopt);
  EXPECT_EQ(AgentOf({{GEN_DNS, "x.pod-a.kvcm-agent.kvcm.svc"}}), std::nullopt);
  EXPECT_EQ(AgentOf({{GEN_DNS, std::string("evil\0pod-a.kvcm-agent.kvcm.svc", 30)}}), std::nullopt);
  absl::StatusOr<std::vector<std::string>> dns =
      DnsSubjectAltNames(MakePem("x", {{GEN_DNS, std::string("a\0b", 3)}, {GEN_DNS, "c"}}));
  ASSERT_TRUE(dns.ok());
  EXPECT_THAT(*dns, ::testing::ElementsAre("c"));
}

TEST(AgentIdentityCertificateTest, EveryDnsNameUnderTheSuffixMustNameTheSameAgent) {
  // Whatever the order, and with names outside the suffix beside it.
  EXPECT_EQ(AgentOf({{GEN_DNS, "localhost"}, {GEN_DNS, "pod-a.kvcm-agent.kvcm.svc"}}), "pod-a");
  EXPECT_EQ(AgentOf({{GEN_DNS, "pod-a.kvcm-agent.kvcm.svc"}, {GEN_DNS, "pod-a.other.svc"}}),
            "pod-a");
  // deploy/k8s's agent certificates also name the node-local Service engines dial: it shares
  // "kvcm-agent" with the suffix but is not under it, so it names no agent.
  EXPECT_EQ(
      AgentOf({{GEN_DNS, "pod-a.kvcm-agent.kvcm.svc"}, {GEN_DNS, "kvcm-agent-local.kvcm.svc"}}),
      "pod-a");
  EXPECT_EQ(AgentOf({{GEN_DNS, "kvcm-agent-local.kvcm.svc"}}), std::nullopt);
  EXPECT_EQ(
      AgentOf({{GEN_DNS, "pod-a.kvcm-agent.kvcm.svc"}, {GEN_DNS, "pod-a.kvcm-agent.kvcm.svc"}}),
      "pod-a");
  // Two agents: refused whole, neither first nor second counts.
  for (const auto& [first, second] :
       {std::pair{"pod-a.kvcm-agent.kvcm.svc", "pod-b.kvcm-agent.kvcm.svc"},
        std::pair{"pod-b.kvcm-agent.kvcm.svc", "pod-a.kvcm-agent.kvcm.svc"}}) {
    absl::StatusOr<std::optional<std::string>> name =
        AgentNameOfCertificate(MakePem("x", {{GEN_DNS, first}, {GEN_DNS, second}}), kSuffix);
    ASSERT_FALSE(name.ok());
    EXPECT_EQ(name.status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_THAT(name.status().message(), HasSubstr("names 2 agents"));
    EXPECT_THAT(name.status().message(), HasSubstr("pod-a"));
    EXPECT_THAT(name.status().message(), HasSubstr("pod-b"));
  }
}

TEST(AgentIdentityCertificateTest, NoSuffixOrNoCertificate) {
  const std::string pem = MakePem("x", {{GEN_DNS, "pod-a.kvcm-agent.kvcm.svc"}});
  absl::StatusOr<std::optional<std::string>> off = AgentNameOfCertificate(pem, "");
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(*off, std::nullopt);
  EXPECT_EQ(AgentNameOfCertificate("not a certificate", kSuffix).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DnsSubjectAltNames("").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcm
