// A minimal stderr logger for kvcm's binaries (Abseil 20220623 has no absl/log).
//
// Lines look like "2026-11-22T10:00:00.123456Z W kvcm-manager] message". Thread-safe: a
// line is written with one fwrite, so concurrent lines do not interleave.
#ifndef KVCM_COMMON_LOG_H_
#define KVCM_COMMON_LOG_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvcm {

enum class LogSeverity : char { kInfo = 'I', kWarning = 'W', kError = 'E' };

// Names the program in every line ("kvcm-manager" until set). Call once at start, before
// any other thread logs; `name` must outlive the process (a literal).
void SetLogProgramName(const char* name);

// Writes one line to stderr.
void LogLine(LogSeverity severity, absl::string_view message);

inline void LogInfo(absl::string_view message) { LogLine(LogSeverity::kInfo, message); }
inline void LogWarning(absl::string_view message) { LogLine(LogSeverity::kWarning, message); }
inline void LogError(absl::string_view message) { LogLine(LogSeverity::kError, message); }

// Lets through at most `max_lines` lines per `period` and counts the rest, so that a flood
// of bad requests cannot turn the log into the bottleneck. Thread-safe.
class LogRateLimiter {
 public:
  LogRateLimiter(int max_lines, absl::Duration period) : max_lines_(max_lines), period_(period) {}

  // Logs `message` if the current period still has room. When a new period starts after
  // lines were dropped, the logged line says how many.
  void Log(LogSeverity severity, absl::string_view message) ABSL_LOCKS_EXCLUDED(mu_);

  // Lines dropped since the limiter was created.
  uint64_t suppressed_total() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const int max_lines_;
  const absl::Duration period_;
  mutable absl::Mutex mu_;
  absl::Time period_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int lines_in_period_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t suppressed_since_last_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t suppressed_total_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcm

#endif  // KVCM_COMMON_LOG_H_
