#include "gpu/agent/server/stream_limiter.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcm {

StreamLimiter::Slot& StreamLimiter::Slot::operator=(Slot&& other) noexcept {
  if (this != &other) {
    Release();
    limiter_ = std::exchange(other.limiter_, nullptr);
    principal_ = std::move(other.principal_);
  }
  return *this;
}

void StreamLimiter::Slot::Release() {
  if (limiter_ != nullptr) std::exchange(limiter_, nullptr)->Release(principal_);
}

absl::StatusOr<StreamLimiter::Slot> StreamLimiter::Acquire(const std::string& principal) {
  absl::MutexLock lock(&mu_);
  uint32_t& n = open_[principal];
  if (n >= max_streams_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("principal ", principal, " has ", n,
                     " WriteBlocks/ReadBlocks streams open, the agent's "
                     "max_streams_per_principal; retry when one ends"));
  }
  ++n;
  return Slot(this, principal);
}

uint32_t StreamLimiter::open(const std::string& principal) const {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(principal);
  return it == open_.end() ? 0 : it->second;
}

void StreamLimiter::Release(const std::string& principal) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(principal);
  if (it == open_.end()) return;
  if (--it->second == 0) open_.erase(it);
}

}  // namespace kvcm
