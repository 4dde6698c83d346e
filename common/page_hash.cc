#include "common/page_hash.h"

#include "absl/base/internal/endian.h"
#include "absl/strings/str_format.h"
#include "common/page_hash_core.h"

namespace kvcm {
namespace {

namespace core = page_hash_core;

core::Hash128 ToCore(const PageHash& h) { return core::Hash128{h.lo, h.hi}; }
PageHash FromCore(const core::Hash128& h) { return PageHash{h.lo, h.hi}; }

}  // namespace

std::string PageHash::ToHex() const { return absl::StrFormat("%016x%016x", hi, lo); }

std::string HashKey::ToBytes() const {
  std::string out(16, '\0');
  absl::little_endian::Store64(out.data(), k0);
  absl::little_endian::Store64(out.data() + 8, k1);
  return out;
}

HashKey HashKey::FromBytes(std::string_view bytes) {
  return HashKey{absl::little_endian::Load64(bytes.data()),
                 absl::little_endian::Load64(bytes.data() + 8)};
}

PageHash SipHash128(const HashKey& key, std::string_view data) {
  return FromCore(core::SipHash128(key.k0, key.k1, data));
}

HashKey DeriveNamespaceKey(const HashKey& secret, std::string_view tenant, std::string_view model) {
  const core::Hash128 h = core::DeriveNamespaceKey(secret.k0, secret.k1, tenant, model);
  return HashKey{h.lo, h.hi};
}

uint64_t KeyFingerprint(const HashKey& key) { return core::KeyFingerprint(key.k0, key.k1); }

PageHash HashPage(const HashKey& key, const PageHash& prev, std::span<const int32_t> tokens) {
  return FromCore(core::HashPage(key.k0, key.k1, ToCore(prev), tokens.data(), tokens.size()));
}

std::vector<PageHash> HashPages(const HashKey& key, std::span<const int32_t> tokens,
                                uint32_t page_size_tokens) {
  // PageHash and core::Hash128 are both {lo, hi}; hash into the core type, then copy.
  std::vector<core::Hash128> hashes(tokens.size() / page_size_tokens);
  core::HashPages(key.k0, key.k1, core::Hash128{}, tokens.data(), tokens.size(), page_size_tokens,
                  hashes.data());
  std::vector<PageHash> pages(hashes.size());
  for (size_t i = 0; i < hashes.size(); ++i) pages[i] = FromCore(hashes[i]);
  return pages;
}

std::string EncodePageHashes(std::span<const PageHash> pages) {
  std::string out(pages.size() * 16, '\0');
  for (size_t i = 0; i < pages.size(); ++i) {
    absl::little_endian::Store64(out.data() + 16 * i, pages[i].lo);
    absl::little_endian::Store64(out.data() + 16 * i + 8, pages[i].hi);
  }
  return out;
}

std::vector<PageHash> DecodePageHashes(std::string_view bytes) {
  std::vector<PageHash> pages(bytes.size() / 16);
  for (size_t i = 0; i < pages.size(); ++i) {
    pages[i].lo = absl::little_endian::Load64(bytes.data() + 16 * i);
    pages[i].hi = absl::little_endian::Load64(bytes.data() + 16 * i + 8);
  }
  return pages;
}

}  // namespace kvcm
