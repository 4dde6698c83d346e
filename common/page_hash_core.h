// The page-hash construction of docs/HASHING.md on plain integers: SipHash-2-4-128, the
// chained page hash, the namespace key and its fingerprint. Header-only and free of Abseil
// and the rest of kvcm, so that common/page_hash.cc and the Python extension
// (client/python/kvcm/_pagehash.cc) compile the very same code.
//
// Keys are (k0, k1), the two little-endian 64-bit halves of the 16 key bytes; a hash is
// (lo, hi), the wire's le64(lo) || le64(hi). All functions are pure and thread-safe.
#ifndef KVCM_COMMON_PAGE_HASH_CORE_H_
#define KVCM_COMMON_PAGE_HASH_CORE_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace kvcm::page_hash_core {

static_assert(std::endian::native == std::endian::little,
              "the wire layout of page hashes assumes a little-endian host");

// A 128-bit hash; on a little-endian host its memory is its 16 wire bytes.
struct Hash128 {
  uint64_t lo = 0;
  uint64_t hi = 0;
};
static_assert(sizeof(Hash128) == 16);

inline uint64_t Load64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// The SipHash-2-4 state, fed in 8-byte words so that HashPage can stream tokens without
// building a byte buffer.
class SipHash128State {
 public:
  SipHash128State(uint64_t k0, uint64_t k1)
      : v0_(0x736f6d6570736575ULL ^ k0),
        v1_(0x646f72616e646f6dULL ^ k1 ^ 0xee),
        v2_(0x6c7967656e657261ULL ^ k0),
        v3_(0x7465646279746573ULL ^ k1) {}

  void Word(uint64_t m) {
    v3_ ^= m;
    Round();
    Round();
    v0_ ^= m;
  }

  // Feeds `data`; every call but the last must pass a multiple of 8 bytes.
  void Bytes(std::string_view data) {
    const size_t n = data.size() & ~size_t{7};
    for (size_t i = 0; i < n; i += 8) Word(Load64(data.data() + i));
    tail_ = data.substr(n);
    total_ += data.size();
  }

  // Counts `bytes` fed through Word() in the message length.
  void AddLength(size_t bytes) { total_ += bytes; }

  Hash128 Finish() {
    uint64_t b = static_cast<uint64_t>(total_) << 56;
    for (size_t i = 0; i < tail_.size(); ++i) {
      b |= static_cast<uint64_t>(static_cast<uint8_t>(tail_[i])) << (8 * i);
    }
    Word(b);
    v2_ ^= 0xee;
    for (int i = 0; i < 4; ++i) Round();
    Hash128 out;
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

// SipHash-2-4 with 128-bit output over `data` (the reference algorithm's `outlen == 16`).
inline Hash128 SipHash128(uint64_t k0, uint64_t k1, std::string_view data) {
  SipHash128State state(k0, k1);
  state.Bytes(data);
  return state.Finish();
}

// Key of namespace (tenant, model) under the secret (s0, s1):
//   SipHash128(secret, "kvcm/ns/v1" || le32(|tenant|) || tenant || le32(|model|) || model).
// Returned as (lo, hi) = (k0, k1) of the namespace key.
inline Hash128 DeriveNamespaceKey(uint64_t s0, uint64_t s1, std::string_view tenant,
                                  std::string_view model) {
  std::string msg = "kvcm/ns/v1";
  auto append_le32 = [&msg](size_t v) {
    const uint32_t le = static_cast<uint32_t>(v);
    msg.append(reinterpret_cast<const char*>(&le), 4);
  };
  append_le32(tenant.size());
  msg.append(tenant);
  append_le32(model.size());
  msg.append(model);
  return SipHash128(s0, s1, msg);
}

// Public fingerprint of a namespace key: SipHash128(key, "kvcm/fingerprint/v1").lo.
inline uint64_t KeyFingerprint(uint64_t k0, uint64_t k1) {
  return SipHash128(k0, k1, "kvcm/fingerprint/v1").lo;
}

// Hash of one page of `n` tokens given the previous page's hash.
inline Hash128 HashPage(uint64_t k0, uint64_t k1, const Hash128& prev, const int32_t* tokens,
                        size_t n) {
  SipHash128State state(k0, k1);
  state.Word(prev.lo);
  state.Word(prev.hi);
  // Two little-endian int32 tokens make one 64-bit word (the host is little-endian).
  const size_t pairs = n / 2;
  for (size_t i = 0; i < pairs; ++i) state.Word(Load64(tokens + 2 * i));
  std::string_view tail;
  if (n % 2 == 1) tail = std::string_view(reinterpret_cast<const char*>(tokens + n - 1), 4);
  state.AddLength(16 + 8 * pairs);
  state.Bytes(tail);
  return state.Finish();
}

// Chained hashes of the n / page_size whole pages of `tokens`, the first chained to `prev`,
// written to out[0 .. n / page_size). REQUIRES: page_size > 0.
inline void HashPages(uint64_t k0, uint64_t k1, Hash128 prev, const int32_t* tokens, size_t n,
                      size_t page_size, Hash128* out) {
  const size_t pages = n / page_size;
  for (size_t i = 0; i < pages; ++i) {
    prev = HashPage(k0, k1, prev, tokens + i * page_size, page_size);
    out[i] = prev;
  }
}

}  // namespace kvcm::page_hash_core

#endif  // KVCM_COMMON_PAGE_HASH_CORE_H_
