// How kvcmctl prints what the manager and the model catalogue report: byte sizes, lease
// expiries, watched events, the 'stats' tables and the 'models' table. Everything goes to
// stdout; the formats are what operators and the process tests read, so keep them stable.
#ifndef KVCM_CLIENT_KVCMCTL_PRINT_H_
#define KVCM_CLIENT_KVCMCTL_PRINT_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/model_spec.h"

namespace kvcm::cli {

// "512 B" below 1 KiB, else two decimals of the largest binary unit: "4.29 MiB".
std::string HumanBytes(uint64_t bytes);

// "none" for absl::InfinitePast(), else UTC with milliseconds and the time left:
// "2025-01-02T03:04:05.678Z (in 29998 ms)".
std::string FormatExpiry(absl::Time t);

// One line per event: "seq=N KIND ns=... pool=... pages=N[ first=HASH]".
void PrintEvent(const WatchedEvent& e);

// The 'stats' report of the manager at `address`: a header, then POOLS, NAMESPACES, AGENTS
// and COUNTERS tables.
void PrintStats(absl::string_view address, const ManagerStats& stats);

// The 'models' table: a row per catalogue model and dtype of `dtypes`, pages of
// `page_size_tokens` (REQUIRES: a valid ModelSpec page size), then a legend. Returns the
// error of a model the catalogue cannot build, with the rows before it already printed
// and no legend.
absl::Status PrintModels(std::span<const KvDtype> dtypes, uint32_t page_size_tokens);
// The same rows as one JSON object (--json): {"page_size_tokens":N,"models":[{"name":...,
// "kv_dtype":..., "bytes_per_token":..., ...}]}, printed only when every row could be built.
absl::Status PrintModelsJson(std::span<const KvDtype> dtypes, uint32_t page_size_tokens);

}  // namespace kvcm::cli

#endif  // KVCM_CLIENT_KVCMCTL_PRINT_H_
