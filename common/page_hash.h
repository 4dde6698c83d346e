// The kvcm page hash: a 128-bit chained, per-namespace keyed hash of token pages.
//
//   h_{-1} = 0 (16 zero bytes)
//   h_i    = SipHash-2-4-128(key_ns, le64(h_{i-1}.lo) || le64(h_{i-1}.hi) ||
//                                    le32(token_0) || ... || le32(token_{page_size-1}))
//
// key_ns is a per-namespace secret derived from the manager's secret (DeriveNamespaceKey),
// so equal tokens in two namespaces never produce equal hashes. The full byte layout and
// test vectors are in docs/HASHING.md and tests/data/page_hash_vectors.txt; any language
// that implements SipHash-2-4 with 128-bit output can reproduce them.
//
// All functions here are pure and thread-safe.
#ifndef KVCM_COMMON_PAGE_HASH_H_
#define KVCM_COMMON_PAGE_HASH_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvcm {

// Version of the construction above; sent by clients in HashScheme.version.
inline constexpr uint32_t kPageHashVersion = 1;

struct PageHash {
  uint64_t lo = 0;
  uint64_t hi = 0;

  friend bool operator==(const PageHash&, const PageHash&) = default;
  friend auto operator<=>(const PageHash&, const PageHash&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const PageHash& p) {
    // Both words: a client that computes its own hashes could otherwise send pages that
    // share their low word and pile them into one bucket of every map keyed by them.
    return H::combine(std::move(h), p.lo, p.hi);
  }
  std::string ToHex() const;  // 32 hex digits, hi first.
};

// 128-bit SipHash key (k0 = first 8 key bytes little-endian, k1 = next 8).
struct HashKey {
  uint64_t k0 = 0;
  uint64_t k1 = 0;
  friend bool operator==(const HashKey&, const HashKey&) = default;

  // 16 bytes, k0 then k1, little-endian.
  std::string ToBytes() const;
  // REQUIRES: bytes.size() == 16.
  static HashKey FromBytes(std::string_view bytes);
};

// SipHash-2-4 with 128-bit output over `data` (the reference algorithm's `outlen == 16`).
PageHash SipHash128(const HashKey& key, std::string_view data);

// Key of namespace (tenant, model) under the manager's secret:
//   SipHash128(secret, "kvcm/ns/v1" || le32(|tenant|) || tenant || le32(|model|) || model).
HashKey DeriveNamespaceKey(const HashKey& secret, std::string_view tenant, std::string_view model);

// Public 64-bit fingerprint of a namespace key, sent with client-computed hashes so the
// manager can refuse a client that hashes with the wrong key:
//   SipHash128(key, "kvcm/fingerprint/v1").lo
uint64_t KeyFingerprint(const HashKey& key);

// Hash of one page given the previous page's hash. REQUIRES: tokens is one whole page.
PageHash HashPage(const HashKey& key, const PageHash& prev, std::span<const int32_t> tokens);

// Chained hashes of every whole page of `tokens`; a trailing partial page is ignored.
// REQUIRES: page_size_tokens > 0.
std::vector<PageHash> HashPages(const HashKey& key, std::span<const int32_t> tokens,
                                uint32_t page_size_tokens);

// Wire form of page hashes (Prompt.page_hashes): 16 bytes each, le64(lo) then le64(hi).
std::string EncodePageHashes(std::span<const PageHash> pages);
// REQUIRES: bytes.size() % 16 == 0.
std::vector<PageHash> DecodePageHashes(std::string_view bytes);

}  // namespace kvcm

#endif  // KVCM_COMMON_PAGE_HASH_H_
