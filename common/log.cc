#include "common/log.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcm {

namespace {
const char* program_name = "kvcm-manager";
}  // namespace

void SetLogProgramName(const char* name) { program_name = name; }

void LogLine(LogSeverity severity, absl::string_view message) {
  std::string line = absl::StrCat(
      absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone()), " ",
      std::string(1, static_cast<char>(severity)), " ", program_name, "] ", message, "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

void LogRateLimiter::Log(LogSeverity severity, absl::string_view message) {
  uint64_t dropped = 0;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - period_start_ >= period_) {
      period_start_ = now;
      lines_in_period_ = 0;
    }
    if (lines_in_period_ >= max_lines_) {
      ++suppressed_since_last_;
      ++suppressed_total_;
      return;
    }
    ++lines_in_period_;
    dropped = suppressed_since_last_;
    suppressed_since_last_ = 0;
  }
  if (dropped == 0) {
    LogLine(severity, message);
  } else {
    LogLine(severity, absl::StrCat(message, " (", dropped, " similar lines suppressed)"));
  }
}

uint64_t LogRateLimiter::suppressed_total() const {
  absl::MutexLock lock(&mu_);
  return suppressed_total_;
}

}  // namespace kvcm
