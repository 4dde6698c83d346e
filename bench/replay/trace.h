// Request traces for kvcm-bench: what each request asks for (the page hashes of its
// prompt), when it arrives and how long it decodes.
//
// Two input formats, both JSON lines (one object per line):
//   Mooncake  {"timestamp": ms, "input_length": tokens, "output_length": tokens,
//              "hash_ids": [...]}: one id per 512-token block, prefix-chained (an id always
//              follows the same predecessor), the last block possibly partial:
//              len(hash_ids) == ceil(input_length / 512).
//   tokens    {"timestamp": ms, "tokens": [int32, ...], "output_length": tokens}, hashed
//              with the real kvcm page hash (HashPages), trailing partial page dropped.
// Unknown fields are ignored. Errors name the file and line.
//
// Nothing here is thread-safe; the functions are pure apart from file I/O.
#ifndef KVCM_BENCH_REPLAY_TRACE_H_
#define KVCM_BENCH_REPLAY_TRACE_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/page_hash.h"

namespace kvcm::bench {

inline constexpr uint32_t kMooncakeBlockTokens = 512;

struct TraceRequest {
  double arrival_ms = 0;
  // Whole pages of the prompt, chained: equal page i implies equal pages 0..i-1.
  std::vector<PageHash> pages;
  uint64_t prompt_tokens = 0;  // all input tokens, a trailing partial page included
  uint64_t output_tokens = 0;
  // Which model / namespace the request belongs to, for multi-tenant mixes: 0 is
  // ReplayOptions::spec, t > 0 is ReplayOptions::extra_specs[t - 1]. Pages of different
  // tenants never coincide (their traces are hashed under different keys).
  uint32_t tenant = 0;
};

struct Trace {
  std::string name;
  uint32_t page_size_tokens = 0;
  std::vector<TraceRequest> requests;  // by arrival time (stable for equal times)

  // Distinct page hashes over all requests: the pages an unbounded cache would hold.
  uint64_t DistinctPages() const;
  // Sum of pages.size() over all requests.
  uint64_t TotalPages() const;
};

// What to do with a Mooncake prompt's partial last block (input_length % 512 != 0).
enum class PartialBlock : uint8_t {
  // Drop it, as kvcm does: only whole pages are ever cached (ARCHITECTURE section 1).
  kDrop,
  // Keep it as a page, so that every hash id counts as one block. This is how the trace's
  // published figures (traces/README.md: 288,500 blocks, 36.64 % hits unbounded) count; it
  // exists to reproduce them, not to model a cache.
  kKeepAsBlock,
};

struct MooncakeReadOptions {
  PartialBlock partial_last_block = PartialBlock::kDrop;
  // Read at most this many requests (0: all).
  size_t max_requests = 0;
};

// The page of Mooncake block id `id`. Ids are already prefix-chained, so a fixed one-to-one
// mix of the id is enough to keep equal prefixes equal; no chaining is needed.
PageHash MooncakeBlockPage(uint64_t id);

// Reads a Mooncake trace; page size 512. Requests are sorted by timestamp.
absl::StatusOr<Trace> ReadMooncakeTrace(const std::string& path,
                                        const MooncakeReadOptions& options = {});

// One request of a token-level trace, before hashing.
struct TokenRequest {
  double arrival_ms = 0;
  std::vector<int32_t> tokens;
  uint64_t output_tokens = 0;
};

absl::StatusOr<std::vector<TokenRequest>> ReadTokenTrace(const std::string& path);
absl::Status WriteTokenTrace(const std::string& path, std::span<const TokenRequest> requests);

// Hashes token requests into a trace with `page_size_tokens`-token pages under `key`,
// sorted by arrival time. REQUIRES: page_size_tokens > 0.
Trace HashTokenTrace(std::string name, std::span<const TokenRequest> requests, const HashKey& key,
                     uint32_t page_size_tokens);

}  // namespace kvcm::bench

#endif  // KVCM_BENCH_REPLAY_TRACE_H_
