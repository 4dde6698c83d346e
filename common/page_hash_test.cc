#include "common/page_hash.h"

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace kvcm {
namespace {

std::string Hex(const PageHash& h) {
  return absl::BytesToHexString(EncodePageHashes(std::span<const PageHash>(&h, 1)));
}

HashKey KeyFromHex(const std::string& hex) {
  return HashKey::FromBytes(absl::HexStringToBytes(hex));
}

// Reference vectors of SipHash-2-4-128 (veorq/SipHash vectors.h, vectors_sip128): key
// 00..0f, message 00..len-1.
TEST(SipHash128Test, MatchesReferenceVectors) {
  const char* kExpected[] = {
      "a3817f04ba25a8e66df67214c7550293", "da87c1d86b99af44347659119b22fc45",
      "8177228da4a45dc7fca38bdef60affe4", "9c70b60c5267a94e5f33b6b02985ed51",
      "f88164c12d9c8faf7d0f6e7c7bcd5579", "1368875980776f8854527a07690e9627",
      "14eeca338b208613485ea0308fd7a15e", "a1f1ebbed8dbc153c0b84aa61ff08239",
      "3b62a9ba6258f5610f83e264f31497b4", "264499060ad9baabc47f8b02bb6d71ed",
  };
  std::string key_bytes, msg;
  for (int i = 0; i < 16; ++i) key_bytes.push_back(static_cast<char>(i));
  const HashKey key = HashKey::FromBytes(key_bytes);
  for (int len = 0; len < 10; ++len) {
    EXPECT_EQ(Hex(SipHash128(key, msg)), kExpected[len]) << "message length " << len;
    msg.push_back(static_cast<char>(len));
  }
}

// tests/data/page_hash_vectors.txt is written by an independent Python implementation
// (scripts/page_hash_vectors.py); every line must reproduce exactly.
TEST(PageHashTest, MatchesCheckedInVectors) {
  std::ifstream in(std::string(KVCM_TEST_DATA_DIR) + "/page_hash_vectors.txt");
  ASSERT_TRUE(in) << "missing page_hash_vectors.txt";
  int ns_lines = 0, page_lines = 0;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    if (f[0] == "ns") {
      ASSERT_EQ(f.size(), 6u) << line;
      HashKey key = DeriveNamespaceKey(KeyFromHex(f[1]), f[2], f[3]);
      EXPECT_EQ(absl::BytesToHexString(key.ToBytes()), f[4]) << line;
      uint64_t fingerprint;
      ASSERT_TRUE(absl::SimpleAtoi(f[5], &fingerprint));
      EXPECT_EQ(KeyFingerprint(key), fingerprint) << line;
      ++ns_lines;
    } else if (f[0] == "pages") {
      ASSERT_EQ(f.size(), 5u) << line;
      uint32_t page_size;
      ASSERT_TRUE(absl::SimpleAtoi(f[2], &page_size));
      std::vector<int32_t> tokens;
      for (absl::string_view t : absl::StrSplit(f[3], ',')) {
        int32_t v;
        ASSERT_TRUE(absl::SimpleAtoi(t, &v));
        tokens.push_back(v);
      }
      std::vector<std::string> want = absl::StrSplit(f[4], ',');
      std::vector<PageHash> got = HashPages(KeyFromHex(f[1]), tokens, page_size);
      ASSERT_EQ(got.size(), want.size()) << line;
      for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(Hex(got[i]), want[i]) << "page " << i;
      ++page_lines;
    }
  }
  EXPECT_EQ(ns_lines, 9);
  EXPECT_EQ(page_lines, 4);
}

TEST(PageHashTest, ChainsAndIgnoresPartialPage) {
  const HashKey key{1, 2};
  std::vector<int32_t> tokens(10);
  for (int i = 0; i < 10; ++i) tokens[i] = i;
  std::vector<PageHash> pages = HashPages(key, tokens, 4);
  ASSERT_EQ(pages.size(), 2u);
  EXPECT_EQ(pages[0], HashPage(key, PageHash{}, std::span(tokens).first(4)));
  EXPECT_EQ(pages[1], HashPage(key, pages[0], std::span(tokens).subspan(4, 4)));
  EXPECT_TRUE(HashPages(key, std::span(tokens).first(3), 4).empty());
}

TEST(PageHashTest, EqualPagesAfterDifferentPrefixesDiffer) {
  const HashKey key{1, 2};
  std::vector<int32_t> a = {1, 2, 9, 9}, b = {3, 4, 9, 9};
  EXPECT_NE(HashPages(key, a, 2)[1], HashPages(key, b, 2)[1]);
}

TEST(PageHashTest, NamespacesNeverShareHashes) {
  const HashKey secret{42, 43};
  std::vector<int32_t> tokens = {5, 6, 7, 8};
  HashKey a = DeriveNamespaceKey(secret, "tenant-a", "m");
  HashKey b = DeriveNamespaceKey(secret, "tenant-b", "m");
  // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
  EXPECT_NE(DeriveNamespaceKey(secret, "ab", "c"), DeriveNamespaceKey(secret, "a", "bc"));
  EXPECT_NE(HashPages(a, tokens, 4), HashPages(b, tokens, 4));
  EXPECT_NE(KeyFingerprint(a), KeyFingerprint(b));
}

TEST(PageHashTest, WireEncodingRoundTrips) {
  std::vector<PageHash> pages = {{1, 2}, {0xdeadbeef, 0xfeedface}};
  std::string wire = EncodePageHashes(pages);
  ASSERT_EQ(wire.size(), 32u);
  EXPECT_EQ(static_cast<uint8_t>(wire[0]), 1);  // lo first, little-endian
  EXPECT_EQ(static_cast<uint8_t>(wire[8]), 2);  // then hi
  EXPECT_EQ(DecodePageHashes(wire), pages);
  HashKey key{7, 8};
  EXPECT_EQ(HashKey::FromBytes(key.ToBytes()), key);
}

}  // namespace
}  // namespace kvcm
