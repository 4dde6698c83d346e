#include "bench/replay/trace.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "bench/replay/json_line.h"
#include "bench/workload.h"

namespace kvcm::bench {
namespace {

// Bounds that keep every derived quantity far from overflow: a year of milliseconds, 2^40
// tokens per request.
constexpr double kMaxTimestampMs = 365.0 * 24 * 3600 * 1000;
constexpr int64_t kMaxTokens = int64_t{1} << 40;

// Calls `fn(line_no, object)` for every non-blank line of `path`; errors get "path:line: ".
template <typename Fn>
absl::Status ForEachJsonLine(const std::string& path, Fn fn) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open trace ", path));
  std::string line;
  for (size_t line_no = 1; std::getline(in, line); ++line_no) {
    if (absl::StripAsciiWhitespace(absl::string_view(line)).empty()) continue;
    absl::Status s = [&]() -> absl::Status {
      absl::StatusOr<JsonObject> object = JsonObject::Parse(line);
      if (!object.ok()) return object.status();
      return fn(*object);
    }();
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat(path, ":", line_no, ": ", s.message()));
    }
    if (fn.done()) break;
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return absl::OkStatus();
}

void SortByArrival(std::vector<TraceRequest>& requests) {
  std::stable_sort(
      requests.begin(), requests.end(),
      [](const TraceRequest& a, const TraceRequest& b) { return a.arrival_ms < b.arrival_ms; });
}

}  // namespace

uint64_t Trace::DistinctPages() const {
  absl::flat_hash_set<PageHash> seen;
  seen.reserve(TotalPages());
  for (const TraceRequest& r : requests) seen.insert(r.pages.begin(), r.pages.end());
  return seen.size();
}

uint64_t Trace::TotalPages() const {
  uint64_t n = 0;
  for (const TraceRequest& r : requests) n += r.pages.size();
  return n;
}

PageHash MooncakeBlockPage(uint64_t id) {
  uint64_t state = id;
  const uint64_t lo = SplitMix64(state);
  return PageHash{lo, SplitMix64(state)};
}

absl::StatusOr<Trace> ReadMooncakeTrace(const std::string& path,
                                        const MooncakeReadOptions& options) {
  Trace trace;
  trace.name = "mooncake";
  trace.page_size_tokens = kMooncakeBlockTokens;
  struct Reader {
    const MooncakeReadOptions& options;
    Trace& trace;
    bool done() const {
      return options.max_requests != 0 && trace.requests.size() >= options.max_requests;
    }
    absl::Status operator()(const JsonObject& o) {
      TraceRequest r;
      absl::StatusOr<double> ts = o.Number("timestamp", 0, kMaxTimestampMs);
      if (!ts.ok()) return ts.status();
      absl::StatusOr<int64_t> in = o.Integer("input_length", 0, kMaxTokens);
      if (!in.ok()) return in.status();
      absl::StatusOr<int64_t> out = o.Integer("output_length", 0, kMaxTokens);
      if (!out.ok()) return out.status();
      absl::StatusOr<const std::vector<int64_t>*> ids =
          o.IntArray("hash_ids", 0, std::numeric_limits<int64_t>::max());
      if (!ids.ok()) return ids.status();
      const uint64_t blocks = (*in + kMooncakeBlockTokens - 1) / kMooncakeBlockTokens;
      if ((*ids)->size() != blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("hash_ids has ", (*ids)->size(), " ids but input_length ", *in,
                         " needs ceil(", *in, " / ", kMooncakeBlockTokens, ") = ", blocks));
      }
      const size_t keep = options.partial_last_block == PartialBlock::kKeepAsBlock
                              ? blocks
                              : static_cast<size_t>(*in / kMooncakeBlockTokens);
      r.arrival_ms = *ts;
      r.prompt_tokens = static_cast<uint64_t>(*in);
      r.output_tokens = static_cast<uint64_t>(*out);
      r.pages.reserve(keep);
      for (size_t i = 0; i < keep; ++i) r.pages.push_back(MooncakeBlockPage((**ids)[i]));
      trace.requests.push_back(std::move(r));
      return absl::OkStatus();
    }
  };
  if (absl::Status s = ForEachJsonLine(path, Reader{options, trace}); !s.ok()) return s;
  SortByArrival(trace.requests);
  return trace;
}

absl::StatusOr<std::vector<TokenRequest>> ReadTokenTrace(const std::string& path) {
  std::vector<TokenRequest> requests;
  struct Reader {
    std::vector<TokenRequest>& requests;
    bool done() const { return false; }
    absl::Status operator()(const JsonObject& o) {
      TokenRequest r;
      absl::StatusOr<double> ts = o.Number("timestamp", 0, kMaxTimestampMs);
      if (!ts.ok()) return ts.status();
      absl::StatusOr<const std::vector<int64_t>*> tokens = o.IntArray(
          "tokens", std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max());
      if (!tokens.ok()) return tokens.status();
      absl::StatusOr<int64_t> out = o.Integer("output_length", 0, kMaxTokens);
      if (!out.ok()) return out.status();
      r.arrival_ms = *ts;
      r.tokens.assign((*tokens)->begin(), (*tokens)->end());
      r.output_tokens = static_cast<uint64_t>(*out);
      requests.push_back(std::move(r));
      return absl::OkStatus();
    }
  };
  if (absl::Status s = ForEachJsonLine(path, Reader{requests}); !s.ok()) return s;
  return requests;
}

absl::Status WriteTokenTrace(const std::string& path, std::span<const TokenRequest> requests) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot create ", path));
  for (const TokenRequest& r : requests) {
    // %.17g round-trips every double, so a re-read trace replays identically.
    std::fprintf(f, "{\"timestamp\": %.17g, \"tokens\": [", r.arrival_ms);
    for (size_t i = 0; i < r.tokens.size(); ++i) {
      std::fprintf(f, i == 0 ? "%d" : ", %d", r.tokens[i]);
    }
    std::fprintf(f, "], \"output_length\": %llu}\n",
                 static_cast<unsigned long long>(r.output_tokens));
  }
  const bool failed = std::ferror(f) != 0;
  if (std::fclose(f) != 0 || failed)
    return absl::DataLossError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

Trace HashTokenTrace(std::string name, std::span<const TokenRequest> requests, const HashKey& key,
                     uint32_t page_size_tokens) {
  Trace trace;
  trace.name = std::move(name);
  trace.page_size_tokens = page_size_tokens;
  trace.requests.reserve(requests.size());
  for (const TokenRequest& r : requests) {
    trace.requests.push_back(TraceRequest{.arrival_ms = r.arrival_ms,
                                          .pages = HashPages(key, r.tokens, page_size_tokens),
                                          .prompt_tokens = r.tokens.size(),
                                          .output_tokens = r.output_tokens});
  }
  SortByArrival(trace.requests);
  return trace;
}

}  // namespace kvcm::bench
