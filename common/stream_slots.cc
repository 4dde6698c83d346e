#include "common/stream_slots.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcm {

std::shared_ptr<StreamSlots> StreamSlots::Create(uint32_t max_per_principal, std::string option) {
  return std::shared_ptr<StreamSlots>(new StreamSlots(max_per_principal, std::move(option)));
}

absl::StatusOr<std::shared_ptr<const Principal>> StreamSlots::Hold(
    absl::StatusOr<std::shared_ptr<const Principal>> caller, absl::string_view stream) {
  if (!caller.ok()) return caller.status();
  std::shared_ptr<const Principal> p = *std::move(caller);
  if (p == OpenPrincipal()) return p;
  {
    absl::MutexLock lock(&mu_);
    uint32_t& held = held_[p->name];
    if (held >= max_per_principal_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("principal ", p->name, " already holds ", held, " open streams (", option_,
                       " = ", max_per_principal_, "); ", stream, " refused: close one first"));
    }
    ++held;
  }
  // An aliasing owner: the principal as before, plus a release when the last copy goes.
  struct Holder {
    std::shared_ptr<const Principal> principal;
    std::shared_ptr<StreamSlots> slots;
    ~Holder() {
      if (slots != nullptr) slots->Release(principal->name);
    }
  };
  auto holder = std::make_shared<Holder>();  // built in place: no temporary to destroy
  holder->principal = p;
  holder->slots = shared_from_this();
  return std::shared_ptr<const Principal>(holder, holder->principal.get());
}

void StreamSlots::Release(const std::string& principal) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(principal);
  if (it != held_.end() && --it->second == 0) held_.erase(it);
}

uint32_t StreamSlots::InUse(absl::string_view principal) const {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(principal);
  return it == held_.end() ? 0 : it->second;
}

}  // namespace kvcm
