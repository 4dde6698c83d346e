#include "common/secure_random.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdlib>

#include "common/log.h"

namespace kvcm {

uint64_t SecureRandom::Next64() {
  if (next_ == buffer_.size()) Refill();
  return buffer_[next_++];
}

void SecureRandom::Refill() {
  auto* out = reinterpret_cast<char*>(buffer_.data());
  size_t want = sizeof(buffer_);
  while (want > 0) {
    const ssize_t got = getrandom(out, want, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      LogError("getrandom failed: no entropy for unguessable ids");
      std::abort();
    }
    out += got;
    want -= static_cast<size_t>(got);
  }
  next_ = 0;
}

}  // namespace kvcm
