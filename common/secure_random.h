// SecureRandom: unpredictable 64-bit values from the kernel's CSPRNG (getrandom(2)), read a
// page at a time so that one value costs a copy, not a system call. For identifiers a
// client must not be able to guess (pin ids), not for simulation.
//
// Not thread-safe: give each owner its own, or guard it.
#ifndef KVCM_COMMON_SECURE_RANDOM_H_
#define KVCM_COMMON_SECURE_RANDOM_H_

#include <array>
#include <cstddef>
#include <cstdint>

namespace kvcm {

class SecureRandom {
 public:
  SecureRandom() = default;
  SecureRandom(const SecureRandom&) = delete;
  SecureRandom& operator=(const SecureRandom&) = delete;

  // 64 uniformly random bits. Aborts the process if the kernel cannot supply entropy (there
  // is no safe fallback for an unguessable id).
  uint64_t Next64();

 private:
  void Refill();

  std::array<uint64_t, 512> buffer_{};
  size_t next_ = buffer_.size();  // empty: the first call fills it
};

}  // namespace kvcm

#endif  // KVCM_COMMON_SECURE_RANDOM_H_
