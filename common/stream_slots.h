// StreamSlots: caps the long-lived streams (WatchEvents, Commands, ReportInventory, ...) each
// principal may hold open at once, so that one token cannot pin a server's memory and
// threads with idle streams. Keyed by principal name; the open dev-mode principal (no tokens
// file, which stands for every caller at once) is not capped.
//
// Thread-safe.
#ifndef KVCM_COMMON_STREAM_SLOTS_H_
#define KVCM_COMMON_STREAM_SLOTS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/token_table.h"

namespace kvcm {

class StreamSlots : public std::enable_shared_from_this<StreamSlots> {
 public:
  // At most `max_per_principal` (>= 1) streams per principal; refusals name `option`.
  static std::shared_ptr<StreamSlots> Create(uint32_t max_per_principal, std::string option);

  // `caller` holding one slot: the pointer returned gives the slot back when its last copy
  // is destroyed (keep it for the stream's life). RESOURCE_EXHAUSTED naming the option and
  // `stream` when the principal holds the maximum already; an error `caller` is returned as
  // it is.
  absl::StatusOr<std::shared_ptr<const Principal>> Hold(
      absl::StatusOr<std::shared_ptr<const Principal>> caller, absl::string_view stream)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Streams `principal` holds now.
  uint32_t InUse(absl::string_view principal) const ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t max_per_principal() const { return max_per_principal_; }

 private:
  StreamSlots(uint32_t max_per_principal, std::string option)
      : max_per_principal_(max_per_principal), option_(std::move(option)) {}
  void Release(const std::string& principal) ABSL_LOCKS_EXCLUDED(mu_);

  const uint32_t max_per_principal_;
  const std::string option_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, uint32_t> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcm

#endif  // KVCM_COMMON_STREAM_SLOTS_H_
