#include "bench/load/load_driver.h"

#include "absl/strings/str_cat.h"

namespace kvcm::load {

absl::Status LoadOptions::Validate() const {
  auto invalid = [](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(field, " ", why));
  };
  if (address.empty()) {
    return invalid("address", "is empty");
  }
  if (api == Api::kClient && open_loop) {
    return invalid("open_loop", "needs the stub API");
  }
  if (open_loop && !(rate_per_s > 0)) {
    return invalid("rate_per_s", "must be > 0");
  }
  if (concurrency == 0) {
    return invalid("concurrency", "must be > 0");
  }
  if (threads == 0 || threads > concurrency) {
    return invalid("threads", "must be 1..concurrency");
  }
  if (channels == 0) {
    return invalid("channels", "must be > 0");
  }
  if (!(warmup_s >= 0)) {
    return invalid("warmup_s", "must be >= 0");
  }
  if (!(duration_s > 0)) {
    return invalid("duration_s", "must be > 0");
  }
  if (deadline_ms <= 0) {
    return invalid("deadline_ms", "must be > 0");
  }
  return absl::OkStatus();
}

}  // namespace kvcm::load
