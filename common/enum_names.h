// One spelling for each value of the enums every process shares, and their parsers:
// "gpu" | "host" | "disk", "mha" | "mqa" | "gqa" | "mla", "bf16" | "fp16" | "fp8" | "int8".
// Flags, config files, logs, metrics labels and kvcmctl all use these names.
//
// All functions are pure and thread-safe.
#ifndef KVCM_COMMON_ENUM_NAMES_H_
#define KVCM_COMMON_ENUM_NAMES_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_spec.h"
#include "common/types.h"

namespace kvcm {

// Lower-case names; "?" for a value outside the enum.
absl::string_view TierName(Tier tier);
absl::string_view AttentionName(AttentionKind kind);
absl::string_view DtypeName(KvDtype dtype);

// The value named `text`, in any letter case. INVALID_ARGUMENT otherwise, reading
// "<field>: expected gpu|host|disk, got 'ssd'".
absl::StatusOr<Tier> ParseTier(absl::string_view text, absl::string_view field = "tier");
absl::StatusOr<AttentionKind> ParseAttention(absl::string_view text,
                                             absl::string_view field = "attention");
absl::StatusOr<KvDtype> ParseDtype(absl::string_view text, absl::string_view field = "dtype");

}  // namespace kvcm

#endif  // KVCM_COMMON_ENUM_NAMES_H_
