#include "common/page_hash.h"

#include <bit>
#include <cstring>

#include "absl/base/internal/endian.h"
#include "absl/strings/str_format.h"

namespace kvcm {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the wire layout of page hashes assumes a little-endian host");

// The SipHash-2-4 state, written to be fed in 8-byte words so HashPage can stream
// tokens without building a byte buffer.
class SipHash128State {
 public:
  explicit SipHash128State(const HashKey& key)
      : v0_(0x736f6d6570736575ULL ^ key.k0),
        v1_(0x646f72616e646f6dULL ^ key.k1 ^ 0xee),
        v2_(0x6c7967656e657261ULL ^ key.k0),
        v3_(0x7465646279746573ULL ^ key.k1) {}

  void Word(uint64_t m) {
    v3_ ^= m;
    Round();
    Round();
    v0_ ^= m;
  }

  // Feeds `data`; every call but the last must pass a multiple of 8 bytes.
  void Bytes(std::string_view data) {
    size_t n = data.size() & ~size_t{7};
    for (size_t i = 0; i < n; i += 8) Word(absl::little_endian::Load64(data.data() + i));
    tail_ = data.substr(n);
    total_ += data.size();
  }

  void AddLength(size_t bytes) { total_ += bytes; }

  PageHash Finish() {
    uint64_t b = static_cast<uint64_t>(total_) << 56;
    for (size_t i = 0; i < tail_.size(); ++i) {
      b |= static_cast<uint64_t>(static_cast<uint8_t>(tail_[i])) << (8 * i);
    }
    Word(b);
    v2_ ^= 0xee;
    for (int i = 0; i < 4; ++i) Round();
    PageHash out;
    out.lo = v0_ ^ v1_ ^ v2_ ^ v3_;
    v1_ ^= 0xdd;
    for (int i = 0; i < 4; ++i) Round();
    out.hi = v0_ ^ v1_ ^ v2_ ^ v3_;
    return out;
  }

 private:
  void Round() {
    v0_ += v1_;
    v1_ = std::rotl(v1_, 13);
    v1_ ^= v0_;
    v0_ = std::rotl(v0_, 32);
    v2_ += v3_;
    v3_ = std::rotl(v3_, 16);
    v3_ ^= v2_;
    v0_ += v3_;
    v3_ = std::rotl(v3_, 21);
    v3_ ^= v0_;
    v2_ += v1_;
    v1_ = std::rotl(v1_, 17);
    v1_ ^= v2_;
    v2_ = std::rotl(v2_, 32);
  }

  uint64_t v0_, v1_, v2_, v3_;
  std::string_view tail_;
  size_t total_ = 0;
};

void AppendLe32(std::string& out, uint32_t v) {
  char buf[4];
  absl::little_endian::Store32(buf, v);
  out.append(buf, 4);
}

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
  SipHash128State state(key);
  state.Bytes(data);
  return state.Finish();
}

HashKey DeriveNamespaceKey(const HashKey& secret, std::string_view tenant, std::string_view model) {
  std::string msg = "kvcm/ns/v1";
  AppendLe32(msg, static_cast<uint32_t>(tenant.size()));
  msg.append(tenant);
  AppendLe32(msg, static_cast<uint32_t>(model.size()));
  msg.append(model);
  PageHash h = SipHash128(secret, msg);
  return HashKey{h.lo, h.hi};
}

uint64_t KeyFingerprint(const HashKey& key) { return SipHash128(key, "kvcm/fingerprint/v1").lo; }

PageHash HashPage(const HashKey& key, const PageHash& prev, std::span<const int32_t> tokens) {
  SipHash128State state(key);
  state.Word(prev.lo);
  state.Word(prev.hi);
  // Two little-endian int32 tokens make one 64-bit word (host is little-endian).
  size_t pairs = tokens.size() / 2;
  for (size_t i = 0; i < pairs; ++i) {
    uint64_t w;
    std::memcpy(&w, tokens.data() + 2 * i, 8);
    state.Word(w);
  }
  std::string_view tail;
  if (tokens.size() % 2 == 1) {
    tail = std::string_view(reinterpret_cast<const char*>(tokens.data() + tokens.size() - 1), 4);
  }
  state.AddLength(16 + 8 * pairs);
  state.Bytes(tail);
  return state.Finish();
}

std::vector<PageHash> HashPages(const HashKey& key, std::span<const int32_t> tokens,
                                uint32_t page_size_tokens) {
  std::vector<PageHash> pages(tokens.size() / page_size_tokens);
  PageHash prev;
  for (size_t i = 0; i < pages.size(); ++i) {
    prev = HashPage(key, prev, tokens.subspan(i * page_size_tokens, page_size_tokens));
    pages[i] = prev;
  }
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
