// Early-return helpers for absl::Status / absl::StatusOr (Abseil 20220623 has none public).
#ifndef KVCM_COMMON_STATUS_MACROS_H_
#define KVCM_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns `expr`'s status from the enclosing function when it is not OK.
#define KVCM_RETURN_IF_ERROR(expr)                                  \
  do {                                                              \
    if (::absl::Status kvcm_status_ = (expr); !kvcm_status_.ok()) { \
      return kvcm_status_;                                          \
    }                                                               \
  } while (false)

#define KVCM_STATUS_CONCAT_INNER_(a, b) a##b
#define KVCM_STATUS_CONCAT_(a, b) KVCM_STATUS_CONCAT_INNER_(a, b)

// `lhs = value of rexpr` (an absl::StatusOr), or returns its status when it is not OK.
// `lhs` may declare a variable: KVCM_ASSIGN_OR_RETURN(auto x, F());
#define KVCM_ASSIGN_OR_RETURN(lhs, rexpr) \
  KVCM_ASSIGN_OR_RETURN_IMPL_(KVCM_STATUS_CONCAT_(kvcm_statusor_, __LINE__), lhs, rexpr)

#define KVCM_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                \
  if (!statusor.ok()) {                                   \
    return std::move(statusor).status();                  \
  }                                                       \
  lhs = *std::move(statusor)

#endif  // KVCM_COMMON_STATUS_MACROS_H_
